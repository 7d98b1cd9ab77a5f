"""``F.embedding`` of every member as the loop computes it, under ``vmap``.

vmap's batching rules for ``embedding`` look the members up in one flat table of
``N * num_embeddings`` rows, offsetting each member's indices: an index past a
member's rows (or a negative one) reads and trains a neighbouring member's row where
the loop raises ``IndexError``. ``padding_idx`` stays
one row number of that flat table, so only member 0's padding row is kept out of the
gradient and members 1..N-1 train theirs. ``max_norm`` renormalises the looked-up
rows of the weight in place, which has no batching rule at all. This module
intercepts ``F.embedding`` inside a ``FunctionalModule`` call under a ``torch.func``
transform and computes what each member's own ``F.embedding`` computes:

- every index is checked against the member's own table first, as ``F.embedding``
  checks it, and an ``IndexError`` names the member (before ``max_norm`` changes
  anything);
- ``padding_idx``: the lookup without it, whose output at the padding positions is
  cut from autograd (their values are the padding row's, as in the loop, and no
  gradient reaches the padding row, nor any other row from those positions);
- ``max_norm``: each member's looked-up rows renormalised in place in the stacked
  weight, as the loop's ``F.embedding`` does to each module's weight, before the
  lookup;
- ``sparse=True`` with gradients enabled is refused: the ensemble's gradients are
  dense ``[N, ...]`` tensors.
"""

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from .._core import member_offset as _member_offset
from .._core.rollback import save_rows_before_update
from . import torch_functions as _torch_functions


def needs_embedding_rule(module: nn.Module, *, compiling: bool = False) -> bool:
    """Whether ``module`` holds an ``nn.Embedding``: vmap's own rule never checks an
    index against the member's table, and gets ``padding_idx`` and ``max_norm`` wrong
    (``compiling``: only those, as no index is read under torch.compile)."""
    return any(
        isinstance(m, nn.Embedding)
        and (not compiling or m.padding_idx is not None or m.max_norm is not None or m.sparse)
        for m in module.modules()
    )


def _check_indices(input: Tensor, rows: int) -> None:
    """Refuse an index outside ``[0, rows)`` of any member, as ``F.embedding`` does.

    Read on the indices of all members at once, the tensor under vmap's wrappers (the
    values cannot be read through them). Under ``torch.compile`` nothing is read: see
    the how-to page "Unsupported layers".
    """
    if torch.compiler.is_compiling() or not isinstance(input, Tensor):
        return
    level = _torch_compat.vmap_level()
    found = _torch_compat.unwrap_at(input, level) if level is not None else None
    raw, member_dim = found if found is not None else (_torch_compat.fully_unwrapped(input), None)
    if raw.is_floating_point() or raw.is_complex() or raw.numel() == 0:
        return  # F.embedding's own dtype error, or nothing to look up
    with torch.no_grad():
        bad = (raw < 0) | (raw >= rows)
        if not bool(bad.any()):
            return
        value = int(raw[bad][0])
        where = "a shared index"
        if member_dim is not None:
            per_member = bad.movedim(member_dim, 0).reshape(raw.shape[member_dim], -1)
            first = _member_offset.first()  # a chunked call maps a slice of the members
            where = f"member {first + int(per_member.any(1).nonzero()[0, 0])}'s indices"
    raise IndexError(
        f"nn.Embedding: index {value} in {where} is out of range for a table of {rows} "
        f"rows (expected 0 <= index < {rows}, as each member's own F.embedding "
        "requires; the loop raises 'index out of range in self'). Fix the indices, "
        "e.g. the vocabulary size or an off-by-one."
    )


def _padding_row(padding_idx: int, num_embeddings: int) -> int:
    """``padding_idx`` as a row number, checked as ``F.embedding`` checks it."""
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"embedding: padding_idx must be within num_embeddings (expected "
            f"-{num_embeddings} <= padding_idx < {num_embeddings}, got {padding_idx})."
        )
    return padding_idx % num_embeddings


def _renorm_(input: Tensor, weight: Tensor, max_norm: float, norm_type: float) -> None:
    """Each member's looked-up rows of the stacked weight renormalised in place."""
    level = None if torch.compiler.is_compiling() else _torch_compat.vmap_level()
    found_w = found_x = None
    if level is not None:
        found_w = _torch_compat.unwrap_at(weight, level)
        found_x = _torch_compat.unwrap_at(input, level)
    if found_w is None or found_w[1] != 0 or found_x is None:
        raise NotImplementedError(
            "nn.Embedding(max_norm=...): renormalising each member's rows in place is "
            "supported in funcensemble's own vmap only, not under torch.compile, inside "
            "another torch.func transform or on a weight shared by all members. Drop "
            "max_norm (e.g. clip the rows yourself after each step under torch.no_grad()), "
            "or run it eagerly."
        )
    w, (idx, bdim) = found_w[0], found_x
    n, rows = w.shape[0], w.shape[1]
    idx = idx.expand(n, *idx.shape) if bdim is None else idx.movedim(bdim, 0)
    with _torch_compat.lower_transform(), torch.no_grad():
        # A call that fails later puts these rows back (see _rollback).
        members = torch.arange(n, device=idx.device).unsqueeze(1)
        save_rows_before_update(w, (members, idx.reshape(n, -1)))
        if w.stride(0) == rows * w.stride(1):  # the members' rows form one table
            offsets = torch.arange(n, device=idx.device).mul_(rows)
            flat_idx = idx.reshape(n, -1) + offsets.unsqueeze(1)
            torch.embedding_renorm_(w.view(n * rows, *w.shape[2:]), flat_idx, max_norm, norm_type)
        else:
            for i in range(n):
                torch.embedding_renorm_(w[i], idx[i].reshape(-1), max_norm, norm_type)


def embedding_per_member(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    if sparse and torch.is_grad_enabled():
        raise ValueError(
            "nn.Embedding: sparse=True is not supported for training an ensemble (its "
            "gradients are dense [N, ...] tensors; expected sparse=False, got True). "
            "Build the members with sparse=False (the gradients have the same values), "
            "or run inference under torch.no_grad()."
        )
    if padding_idx is not None:
        padding_idx = _padding_row(padding_idx, weight.shape[0])
    _check_indices(input, weight.shape[0])  # before max_norm writes anything
    if max_norm is not None:
        _renorm_(input.contiguous(), weight, max_norm, norm_type)
    embedding = _torch_functions.original(F.embedding)  # (a replacement ran already)
    out = embedding(input, weight, None, None, norm_type, scale_grad_by_freq, False)
    if padding_idx is None:
        return out
    return torch.where((input == padding_idx).unsqueeze(-1), out.detach(), out)


class PerMemberEmbedding(TorchFunctionMode):
    """Within this mode, ``F.embedding`` computes each member's own embedding."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        func = _torch_functions.original(func)  # (a user's replacement runs once)
        if func is F.embedding:
            return embedding_per_member(*args, **kwargs)
        return func(*args, **kwargs)
