"""Which tensors of an in-place step share memory: refused before anything is written.

A step that writes one tensor and then reads another lying in the same memory reads
values it has already changed. The loop over members meets the same tensors one
member's slice at a time, where torch's own check often refuses them ("some elements
of the input tensor and the written-to tensor refer to a single memory location"): a
member's slice of ``base[:, 1:4]`` is dense, the stacked view is not, and torch's
check looks at dense tensors only. So the in-place steps (``update_``,
``polyak_update_``) compare the memory of what they write with everything they read
or write, and refuse a step whose tensors share an element.
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .. import _torch_compat

# Above this many runs of contiguous elements, strided views whose ranges overlap count
# as sharing memory without the run-by-run comparison (which holds an int64 per run).
_EXACT_LIMIT = 1 << 26


def partly_shared(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share some of their elements' memory without being one
    view of it (the same start, shape, strides and dtype): an in-place op writing ``a`` from
    ``b`` would then read elements it has already written. The same memory in another
    order (a transpose) counts as partly shared; strided views that interleave with no
    element in common (``base[:, ::2]`` and ``base[:, 1::2]``) do not. Tensors whose
    memory Python cannot read (a DTensor, another wrapper subclass) count as not."""
    if a is b:
        return False
    span_a, span_b = _span(a), _span(b)
    if span_a is None or span_b is None or one_view(a, b):
        return False
    return _meet(a, b, span_a, span_b)


def unwritable(t: Tensor) -> tuple[str, str] | None:
    """Why torch cannot write ``t`` in place, and what to do, or None: an inference
    tensor outside inference mode, or an expanded view whose elements share memory
    (torch's error would come partway through a step)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return "an inference tensor", "clone it outside torch.inference_mode()"
    if not t.is_contiguous() and _torch_compat.overlaps_itself(t):
        return "an expanded view whose elements share memory", "pass a .clone()"
    return None


def first_clash(
    written: Sequence[Tensor],
    read: Sequence[Tensor] = (),
    allowed: Callable[[int, int], bool] | None = None,
) -> tuple[int, int] | None:
    """Two tensors sharing an element, as ``(i, j)``: ``written[i]`` and ``read[j]``,
    or ``written[i]`` and ``written[-1 - j]`` (one object listed twice included),
    unless they are one view of the same memory and ``allowed(i, j)`` says a written
    and a read tensor may be (an average of a tensor with itself). None if no two do.

    Tensors whose memory Python cannot read (inside a ``torch.func`` transform, a
    DTensor, while compiling) are not compared. The usual case, no two byte ranges
    overlapping, costs one sort of the ranges.
    """
    tensors = [*written, *read]
    spans = []
    for k, t in enumerate(tensors):
        span = _span(t)
        if span is not None:
            spans.append((*span, k))
    spans.sort()  # plain ints: no tensor is ever compared
    reach = 0
    for start, end, _ in spans:
        if start < reach:
            return _first_clash_among(spans, tensors, len(written), allowed)
        if end > reach:
            reach = end
    return None


def _end(t: Tensor, start: int) -> int:
    """The byte after ``t``'s last element (strides are >= 0)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start + (last + 1) * t.element_size()


def _first_clash_among(
    spans: list[tuple[int, int, int]],
    tensors: list[Tensor],
    num_written: int,
    allowed: Callable[[int, int], bool] | None,
) -> tuple[int, int] | None:
    """[`first_clash`][] where some ranges overlap: compare the tensors whose ranges
    do (``spans`` sorted by start; ``tensors`` the written ones, then the read)."""
    open_: list[tuple[int, int, int]] = []
    for s in spans:
        open_ = [o for o in open_ if o[1] > s[0]]
        for o in open_:
            w, r = sorted((o[2], s[2]))  # a written one first, where there is one
            if w >= num_written:  # two tensors only read
                continue
            a, b = tensors[w], tensors[r]
            if r >= num_written:
                j = r - num_written
                if allowed is not None and one_view(a, b) and allowed(w, j):
                    continue
                if a.device == b.device and _meet(a, b, _span(a), _span(b)):
                    return (w, j)
            elif a.device == b.device and _meet(a, b, _span(a), _span(b)):
                return (w, -1 - r)
        open_.append(s)
    return None


def _span(t: Tensor) -> tuple[int, int] | None:
    """The bytes ``[first, end)`` ``t``'s elements lie in, or None (empty, or memory
    Python cannot read)."""
    try:
        start = t.data_ptr()
    except RuntimeError:  # a wrapper subclass or a functorch tensor holds no memory
        return None
    if not start:  # empty, or a meta or fake tensor
        return None
    return start, (start + t.nbytes if t.is_contiguous() else _end(t, start))


def one_view(a: Tensor, b: Tensor) -> bool:
    """The same elements in the same order: each is read where it is written."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def _meet(a: Tensor, b: Tensor, span_a: Sequence[int], span_b: Sequence[int]) -> bool:
    """Whether ``a`` and ``b``, in the byte ranges given, have an element in common."""
    if not (span_a[0] < span_b[1] and span_b[0] < span_a[1]):
        return False
    if _dense(a) and _dense(b):  # each fills its range
        return True
    size, shift = a.element_size(), span_a[0] - span_b[0]
    if b.element_size() != size or shift % size:
        return True
    layout_a, layout_b = _run_layout(a), _run_layout(b)
    if (
        max(math.prod(s for s, _ in layout_a[0]), math.prod(s for s, _ in layout_b[0]))
        > _EXACT_LIMIT
    ):
        return True
    starts_a, run_a = _run_starts(*layout_a)
    starts_b, run_b = _run_starts(*layout_b)
    starts_a = starts_a + shift // size
    starts_b = torch.sort(starts_b).values
    # The last run of b starting before each run of a ends; all of b's runs have one
    # length, so an earlier one ends earlier too.
    last = torch.searchsorted(starts_b, starts_a + run_a) - 1
    ends_b = starts_b[last.clamp(min=0)] + run_b
    return bool(((last >= 0) & (ends_b > starts_a)).any())


def _run_layout(t: Tensor) -> tuple[list[tuple[int, int]], int]:
    """``t``'s runs of contiguous elements: the (size, stride) of the dims outside them,
    and their length (its innermost dims that fill one block make one run)."""
    dims = sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1), key=_stride
    )
    run = 1
    while dims and dims[0][1] == run:
        run *= dims.pop(0)[0]
    return dims, run


def _run_starts(dims: list[tuple[int, int]], run: int) -> tuple[Tensor, int]:
    """The runs' starts, in elements from the first (int64, on the CPU), and length."""
    starts = torch.zeros((), dtype=torch.int64, device="cpu")
    for size, stride in reversed(dims):
        starts = starts.unsqueeze(-1) + torch.arange(size, device="cpu") * stride
    return starts.reshape(-1), run


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory, each once (torch's
    "non-overlapping and dense": contiguous in some order of its dims)."""
    expected = 1
    for size, stride in sorted(
        (p for p in zip(t.shape, t.stride(), strict=True) if p[0] != 1), key=_stride
    ):
        if stride != expected:
            return False
        expected *= size
    return True
