"""funcensemble: run an ensemble of PyTorch models as one vectorized model."""

from . import reduce as reduce
from ._bagging import BaggingSampler as BaggingSampler
from ._bagging import bootstrap_indices as bootstrap_indices
from ._ensemble import Ensemble as Ensemble
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._stack import FunctionalModule as FunctionalModule
from ._stack import stack as stack
from ._stack import unstack as unstack
from ._vmap import vmap as vmap

__version__ = "0.1.0"

__all__ = [
    "BaggingSampler",
    "Ensemble",
    "FunctionalModule",
    "bootstrap_indices",
    "grad",
    "stack",
    "unstack",
    "value_and_grad",
    "vmap",
]
