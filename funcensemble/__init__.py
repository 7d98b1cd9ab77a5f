"""funcensemble: run an ensemble of PyTorch models as one vectorized model."""

from . import optim as optim
from . import reduce as reduce
from ._bagging import BaggingSampler as BaggingSampler
from ._bagging import bootstrap_indices as bootstrap_indices
from ._checkpoint import load as load
from ._checkpoint import save as save
from ._ensemble import Ensemble as Ensemble
from ._export import export_state_dicts as export_state_dicts
from ._export import import_state_dicts as import_state_dicts
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._hetero import HeteroEnsemble as HeteroEnsemble
from ._stack import FunctionalModule as FunctionalModule
from ._stack import stack as stack
from ._stack import unstack as unstack
from ._vmap import vmap as vmap

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
    "export_state_dicts",
    "grad",
    "import_state_dicts",
    "load",
    "save",
    "stack",
    "unstack",
    "value_and_grad",
    "vmap",
]
