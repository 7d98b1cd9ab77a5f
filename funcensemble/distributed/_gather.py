"""The all-gather into one tensor, under the name the running torch prefers."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor


def all_gather_single(out: Tensor, t: Tensor, group: Any = None) -> None:
    """``dist.all_gather_single`` where torch has it, else ``all_gather_into_tensor``.

    torch 2.13 deprecates ``all_gather_into_tensor`` (a ``FutureWarning`` on every
    call) for ``all_gather_single``, which older versions lack; both fill ``out``
    alike. Looked up at each call, so a patched ``torch.distributed`` is honoured.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
