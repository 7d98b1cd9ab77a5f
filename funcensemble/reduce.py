"""Reductions over the member axis of stacked ensemble outputs: ``fe.reduce.mean`` etc."""

from ._gaussian_mixture import GaussianMixture as GaussianMixture
from ._gaussian_mixture import gaussian_mixture as gaussian_mixture
from ._reduce import disagreement as disagreement
from ._reduce import expected_entropy as expected_entropy
from ._reduce import max as max
from ._reduce import mean as mean
from ._reduce import mean_log_probs as mean_log_probs
from ._reduce import mean_probs as mean_probs
from ._reduce import min as min
from ._reduce import mutual_information as mutual_information
from ._reduce import predictive_entropy as predictive_entropy
from ._reduce import std as std
from ._reduce import subset_min as subset_min
from ._reduce import var as var

__all__ = [
    "GaussianMixture",
    "disagreement",
    "expected_entropy",
    "gaussian_mixture",
    "max",
    "mean",
    "mean_log_probs",
    "mean_probs",
    "min",
    "mutual_information",
    "predictive_entropy",
    "std",
    "subset_min",
    "var",
]
