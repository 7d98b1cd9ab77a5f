"""funcensemble: run an ensemble of PyTorch models as one vectorized model."""

from . import optim as optim
from . import reduce as reduce
from ._bagging import BaggingSampler as BaggingSampler
from ._bagging import bootstrap_indices as bootstrap_indices
from ._checkpoint.export import export_state_dicts as export_state_dicts
from ._checkpoint.export import import_state_dicts as import_state_dicts
from ._checkpoint.save_load import load as load
from ._checkpoint.save_load import save as save
from ._core.ensemble import Ensemble as Ensemble
from ._core.functional_module import FunctionalModule as FunctionalModule
from ._core.grad import grad as grad
from ._core.grad import value_and_grad as value_and_grad
from ._core.members import concat as concat
from ._core.members import select as select
from ._core.stack import stack as stack
from ._core.stack import unstack as unstack
from ._core.vmap import vmap as vmap
from ._hetero.ensemble import HeteroEnsemble as HeteroEnsemble
from ._sample_weights import bootstrap_masks as bootstrap_masks
from ._sample_weights import weighted_mean as weighted_mean

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # fe.distributed pulls in torch.distributed.checkpoint (seconds of import time), so
    # it is imported on first use rather than with the package.
    if name == "distributed":
        import importlib

        module = importlib.import_module(f"{__name__}.distributed")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BaggingSampler",
    "Ensemble",
    "FunctionalModule",
    "HeteroEnsemble",
    "bootstrap_indices",
    "bootstrap_masks",
    "concat",
    "export_state_dicts",
    "grad",
    "import_state_dicts",
    "load",
    "save",
    "select",
    "stack",
    "unstack",
    "value_and_grad",
    "vmap",
    "weighted_mean",
]
