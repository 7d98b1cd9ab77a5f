"""The tensors a member's forward updates in place, which a failed call puts back.

Besides the normalization layers' running statistics (``_kernels.batchnorm``),
``spectral_norm``'s power iteration writes its ``_u`` and ``_v`` buffers as the forward
passes (in train mode). ``_rollback`` saves them before the call writes them, by the
names the call was given them under. (``nn.Embedding(max_norm=...)``'s kernel saves
the rows it renormalises itself: see ``_kernels.embedding``.)
"""

from torch import nn
from torch.nn.utils import parametrizations

from .._kernels.batchnorm import norm_layers, updated_in_place


def by_forward(skeleton: nn.Module) -> list[str]:
    """Names of the buffers ``skeleton``'s forward will update in place."""
    names = updated_in_place(norm_layers(skeleton))
    for name, m in skeleton.named_modules():
        if isinstance(m, parametrizations._SpectralNorm) and m.training:
            prefix = f"{name}." if name else ""
            names += [prefix + "_u", prefix + "_v"]
    return names
