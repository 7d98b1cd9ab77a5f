"""The tensors a member's forward updates in place, which a failed call puts back.

Besides the normalization layers' running statistics (``_kernels.batchnorm``), two of
torch's layers write into their own tensors as the forward passes: ``spectral_norm``'s
power iteration (its ``_u`` and ``_v`` buffers, in train mode) and
``nn.Embedding(max_norm=...)``, which renormalises the rows it looks up in its weight.
``_rollback`` saves them before the call writes them, by the names the call was given
them under.
"""

from torch import nn
from torch.nn.utils import parametrizations

from .._kernels.batchnorm import norm_layers, updated_in_place


def by_forward(skeleton: nn.Module) -> list[str]:
    """Names of the parameters and buffers ``skeleton``'s forward will update in place."""
    names = updated_in_place(norm_layers(skeleton))
    renormed = []
    for name, m in skeleton.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, parametrizations._SpectralNorm) and m.training:
            names += [prefix + "_u", prefix + "_v"]
        elif isinstance(m, nn.Embedding) and m.max_norm is not None:
            renormed.append(m.weight)
    if renormed:  # under the name it is stacked by: the first, for a tied weight
        for name, p in skeleton.named_parameters():
            if any(p is w for w in renormed):
                names.append(name)
    return names
