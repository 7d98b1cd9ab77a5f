"""The annotations of stacked things, with the member axis named ``member``.

Every public signature that takes or returns stacked tensors uses these, so the member
axis reads the same everywhere and the test run's runtime checker (jaxtyping with
beartype, pyproject's ``--jaxtyping-packages``) checks it where it can.
"""

from typing import Any

from jaxtyping import Shaped
from torch import Tensor, nn

StackedTensor = Shaped[Tensor, "member ..."]
"""One stacked tensor: the N members' values, member axis first."""

StackedTensors = dict[str, StackedTensor]
"""Stacked tensors by state-dict name, as [`stack`][funcensemble.stack] returns them."""

StackedParameters = dict[str, Shaped[nn.Parameter, "member ..."]]
"""An ``Ensemble``'s live stacked parameters by state-dict name."""

StackedTree = Any
"""A pytree (optree: dicts, lists, tuples, NamedTuples; ``None`` kept as a leaf) whose
tensor leaves are stacked, ``Shaped[Tensor, "member ..."]``, all with one member count N
(e.g. ``fe.stack``'s ``params``, their gradients, a batch of outputs). Left as ``Any``
for the runtime checker: optree's ``PyTree`` hint cannot be resolved at run time; each
function checks the leaves' member axis itself."""
