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

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .. import _torch_compat

# Above this many elements, strided views whose ranges overlap count as sharing memory
# without the element-by-element comparison (which holds two int64 offsets per element).
_EXACT_LIMIT = 1 << 24


def partly_shared(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share some of their elements' memory without being one
    view of it (the same start, shape and strides): an in-place op writing ``a`` from
    ``b`` would then read elements it has already written. The same memory in another
    order (a transpose) counts as partly shared; strided views that interleave with no
    element in common (``base[:, ::2]`` and ``base[:, 1::2]``) do not. Tensors whose
    memory Python cannot read (a DTensor, another wrapper subclass) count as not."""
    if a is b:
        return False
    span_a, span_b = _span(a), _span(b)
    if span_a is None or span_b is None or _one_view(a, b):
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
    spans = []
    for is_written, tensors in ((True, written), (False, read)):
        for index, t in enumerate(tensors):
            try:
                start = t.data_ptr()
            except RuntimeError:  # a wrapper subclass or a functorch tensor holds no memory
                continue
            if start:  # not empty, nor a meta or fake tensor
                end = start + t.nbytes if t.is_contiguous() else _end(t, start)
                spans.append((start, end, is_written, index, t))
    spans.sort(key=_start)
    reach = 0
    for s in spans:
        if s[0] < reach:
            return _first_clash_among(spans, allowed)
        reach = max(reach, s[1])
    return None


def _start(span: tuple[int, int, bool, int, Tensor]) -> int:
    return span[0]


def _end(t: Tensor, start: int) -> int:
    """The byte after ``t``'s last element (strides are >= 0)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start + (last + 1) * t.element_size()


def _first_clash_among(
    spans: list[tuple[int, int, bool, int, Tensor]], allowed: Callable[[int, int], bool] | None
) -> tuple[int, int] | None:
    """[`first_clash`][] where some ranges overlap: compare the tensors element by
    element (``spans`` sorted by start)."""
    open_: list[tuple[int, int, bool, int, Tensor]] = []
    for s in spans:
        open_ = [o for o in open_ if o[1] > s[0]]
        for o in open_:
            if not (o[2] or s[2]):  # two tensors only read
                continue
            w, r = (o, s) if o[2] else (s, o)
            if w[4].device != r[4].device or not _meet(w[4], r[4], w[:2], r[:2]):
                continue
            if not r[2]:  # a written and a read tensor
                if allowed and _one_view(w[4], r[4]) and allowed(w[3], r[3]):
                    continue
                return (w[3], r[3])
            return (w[3], -1 - r[3])
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


def _one_view(a: Tensor, b: Tensor) -> bool:
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
    if b.element_size() != size or shift % size or max(a.numel(), b.numel()) > _EXACT_LIMIT:
        return True
    return bool(torch.isin(_offsets(a) + shift // size, _offsets(b)).any())


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory, each once (torch's
    "non-overlapping and dense": contiguous in some order of its dims)."""
    expected = 1
    for size, stride in sorted(
        (p for p in zip(t.shape, t.stride(), strict=True) if p[0] != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _offsets(t: Tensor) -> Tensor:
    """Each element's offset, in elements, from ``t``'s first one (int64, on the CPU)."""
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, device="cpu") * stride
    return offsets.reshape(-1)
