"""funcensemble: run an ensemble of PyTorch models as one vectorized model."""

from ._ensemble import Ensemble as Ensemble
from ._stack import FunctionalModule as FunctionalModule
from ._stack import stack as stack
from ._stack import unstack as unstack
from ._vmap import vmap as vmap

__version__ = "0.1.0"

__all__ = [
    "Ensemble",
    "FunctionalModule",
    "stack",
    "unstack",
    "vmap",
]
