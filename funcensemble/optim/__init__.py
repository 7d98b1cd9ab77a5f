"""Optimizers over stacked ensemble parameters: ``fe.optim.adam`` etc.

Optax-style: an optimizer is a pair of pure functions ``init(params)`` and
``update(grads, state, params)`` over pytrees of ``[N, ...]`` tensors, computing what
``torch.optim`` computes for each member.
[`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] wraps one in a
``torch.optim``-like object for ``loss.backward()`` loops.
"""

from ._adam import AdamState as AdamState
from ._adam import adam as adam
from ._adam import adamw as adamw
from ._adam import scale_by_adam as scale_by_adam
from ._clip import clip_by_global_norm as clip_by_global_norm
from ._ensemble_optimizer import EnsembleOptimizer as EnsembleOptimizer
from ._members import concat as concat
from ._members import select as select
from ._partition import partition as partition
from ._polyak import polyak_update as polyak_update
from ._polyak import polyak_update_ as polyak_update_
from ._protocol import EmptyState as EmptyState
from ._protocol import GradientTransformation as GradientTransformation
from ._protocol import apply_updates as apply_updates
from ._protocol import chain as chain
from ._rmsprop import RMSpropState as RMSpropState
from ._rmsprop import rmsprop as rmsprop
from ._schedules import cosine_decay as cosine_decay
from ._schedules import linear_warmup as linear_warmup
from ._schedules import warmup_cosine as warmup_cosine
from ._sgd import SGDState as SGDState
from ._sgd import sgd as sgd
from ._transforms import ScheduleState as ScheduleState
from ._transforms import add_decayed_weights as add_decayed_weights
from ._transforms import scale_by_learning_rate as scale_by_learning_rate

__all__ = [
    "AdamState",
    "EmptyState",
    "EnsembleOptimizer",
    "GradientTransformation",
    "RMSpropState",
    "SGDState",
    "ScheduleState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "concat",
    "cosine_decay",
    "linear_warmup",
    "partition",
    "polyak_update",
    "polyak_update_",
    "rmsprop",
    "scale_by_adam",
    "scale_by_learning_rate",
    "select",
    "sgd",
    "warmup_cosine",
]
