"""Everything funcensemble uses from inside PyTorch, in one place.

No other module of the package reaches ``torch._C``, ``torch._functorch`` or
``torch.utils._pytree`` (``tests/test_layout.py`` fails if one does). Each private
name is looked up once, when this module is imported; a torch without it fails at
``import funcensemble`` with an ``ImportError`` naming the call and the version that
has it, never in the middle of a training step.

Inventory (the floor is torch 2.6, ``pyproject.toml``; every call exists from it on):

- ``torch._C._functorch.peek_interpreter_stack`` (torch 2.0): are we inside a
  ``torch.func`` transform, and is the innermost one ``vmap`` (its ``key()`` against
  ``torch._C._functorch.TransformType.Vmap``, its ``level()``)?
- ``torch._C._functorch.is_functorch_wrapped_tensor``, ``is_batchedtensor``,
  ``maybe_get_level``, ``maybe_get_bdim``, ``get_unwrapped`` (2.0): a BatchedTensor's
  plain tensor and member dim. The MLP fast path, the BatchNorm fold and the Embedding
  rule are batching rules for a whole layer; they run on the plain tensors.
- ``torch._C._functorch.is_legacy_batchedtensor`` (2.0): is a gradient batched by
  torch's legacy vmap (``torch.autograd.grad(..., is_grads_batched=True)``,
  vectorized jacobians)? The MLP's kept-buffer backward then uses fresh tensors.
- ``torch._C._functorch._add_batch_dim`` (2.0): hand such a rule's result back to
  vmap as a BatchedTensor.
- ``torch._functorch.pyfunctorch.retrieve_current_functorch_interpreter().lower()``
  (2.0): run the rule's own kernels one transform level down.
- ``torch._functorch.vmap._flat_vmap``, ``_unwrap_batched`` and
  ``lazy_load_decompositions`` (2.0), with a ``torch.utils._pytree.tree_flatten``
  spec, and ``torch._C._functorch._vmap_increment_nesting``,
  ``_vmap_decrement_nesting``, ``_remove_batch_dim`` and
  ``torch._C._is_torch_function_mode_enabled`` (2.0): the steps ``torch.func.vmap``
  takes once it has flattened and checked its inputs, taken directly for inputs that
  are already flat and checked ([`vmap_flat`][]), which skips vmap's Python pytree
  walk.
- ``torch._C._is_torch_function_mode_enabled`` and ``torch._C._len_torch_dispatch_stack``
  (2.0): is a tracer or mode watching torch's ops ([`ops_observed`][])? The fast
  path's NumPy ``tanh`` (``_kernels/tanh.py``) then steps aside for ``torch.tanh``.
- ``torch._C._functorch.pop_dynamic_layer_stack``/``push_dynamic_layer_stack``
  (2.0): what a vmap interpreter's ``lower()`` does, without building the Python
  interpreter object ([`lower_vmap`][]).
- ``torch._C._get_<backend>_sdp_enabled``/``_set_sdp_use_<backend>`` (2.0; the
  ``overrideable`` backend where the version has it): what
  ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` saves, sets and restores, done in
  [`no_silent_vmap_loops`][] without its per-call list building.
- ``torch._C._functorch._is_vmap_fallback_enabled``, ``_set_vmap_fallback_enabled``
  (2.0): refuse vmap's silent per-member loop for an op without a batching rule. A
  process-wide flag: see [`no_silent_vmap_loops`][] for how threads share it.
- ``torch._C._set_grad_enabled`` (1.x): autograd off around a small in-place
  optimizer step without the cost of a ``torch.no_grad()`` object (``_adam.py``).
- ``torch.nn.modules.module._global_forward_hooks`` and its pre/backward kin (2.0): a
  global module hook turns the MLP fast path off (the fast path would skip it); a
  global backward hook is refused inside vmap (``_structure/backward_hooks.py``).
- ``torch.utils._foreach_utils._get_fused_kernels_supported_devices`` (which devices
  have ``torch._fused_adam_``; CPU from 2.4), ``torch._fused_adam_``/``_fused_adamw_``
  and the ``tensor_lr`` overload of ``aten._fused_adam_`` (2.4): the fused Adam kernel
  ``torch.optim.Adam(fused=True)`` runs, looked up where the torch version has them
  ([`fused_adam_devices`][], [`fused_adam_kernel`][], [`fused_adam_takes_tensor_lr`][]).
- ``torch._weight_norm`` (the kernel behind ``weight_norm``): recognised in
  ``_kernels/rewrites.py`` and recomputed as its math, which vmap batches.
- ``torch._C._storage_Use_Count`` (2.0): how many tensors share a storage, so the MLP
  fast path reuses a workspace buffer only when nothing else holds it
  (``_kernels/workspace.py``). Looked up with ``getattr`` and calibrated at import on a
  lone tensor and a view of it (torch 2.6 leaves the Python storage object out of the
  count, 2.7 and later count it once); without it, or if the probe disagrees, no
  buffer is ever reused.
- ``torch.autograd.forward_ad._current_level`` (1.x): a forward-AD dual level is
  active (the fused Linear layers have no forward-mode rule; the plain ops do).
- ``torch._dynamo.comptime.comptime`` (2.0): read the fake tensors' version counters
  while Dynamo traces, to refuse a compiled call that changes a shared input in place
  ([`mark_traced_version`][], [`refuse_traced_change`][]).
- ``torch.distributed.checkpoint.filesystem._StorageInfo`` and
  ``torch.serialization._get_layout`` (2.2): names a DCP ``.metadata`` pickle holds,
  allowed by our restricted unpickler (``_dcp_metadata.py``); and DCP's
  ``StorageMeta``, looked up where the torch version has it (``_dcp_checksums.py``).
- ``torch.distributed.tensor._shards_wrapper.LocalShardsWrapper`` (2.5; torchrec's
  way to hand DCP a DTensor whose rows are split unlike ``torch.chunk``): the local
  tensor of the DTensor view through which a rank's members are checkpointed
  (``distributed/_mesh.py``); and ``DefaultSavePlanner``'s ``dedup_save_to_lowest_rank``
  option (2.4), looked up in its signature.

And texts of torch's own messages that we match, each behind one named helper here:
``missing_batching_rule`` (vmap's error for an op without a batching rule, two
wordings) and ``DCP_NO_PROCESS_GROUP_WARNING`` (DCP's note that it runs without a
process group). ``torch._foreach_*`` kernels (the optimizers) are not listed: they are
the kernels ``torch.optim`` itself documents as its ``foreach`` implementation.
"""

import contextlib
import functools
import importlib
import inspect
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.comptime import comptime as _comptime
from torch._functorch import pyfunctorch as _pyfunctorch
from torch.nn.modules import module as module_mod
from torch.nn.utils import parametrize as _parametrize
from torch.utils import _python_dispatch
from torch.utils import _pytree as _torch_pytree
from torch.utils import checkpoint as _checkpoint


def _require(owner: Any, name: str, where: str, since: str) -> Any:
    found = getattr(owner, name, None)
    if found is None:
        raise ImportError(
            f"funcensemble: this torch ({torch.__version__}) lacks {where}.{name}, which "
            f"funcensemble needs (expected torch >= {since}). Install torch >= 2.6."
        )
    return found


_functorch = _require(torch._C, "_functorch", "torch._C", "2.0")
_peek = _require(_functorch, "peek_interpreter_stack", "torch._C._functorch", "2.0")
_VMAP = _require(_functorch, "TransformType", "torch._C._functorch", "2.0").Vmap
_is_wrapped = _require(_functorch, "is_functorch_wrapped_tensor", "torch._C._functorch", "2.0")
_is_batched = _require(_functorch, "is_batchedtensor", "torch._C._functorch", "2.0")
_level_of = _require(_functorch, "maybe_get_level", "torch._C._functorch", "2.0")
_bdim_of = _require(_functorch, "maybe_get_bdim", "torch._C._functorch", "2.0")
_unwrap = _require(_functorch, "get_unwrapped", "torch._C._functorch", "2.0")
_add_batch_dim = _require(_functorch, "_add_batch_dim", "torch._C._functorch", "2.0")
_fallback_enabled = _require(_functorch, "_is_vmap_fallback_enabled", "torch._C._functorch", "2.0")
_set_fallback = _require(_functorch, "_set_vmap_fallback_enabled", "torch._C._functorch", "2.0")
_set_grad = _require(torch._C, "_set_grad_enabled", "torch._C", "1.0")

_current_interpreter = _require(
    _pyfunctorch, "retrieve_current_functorch_interpreter", "torch._functorch.pyfunctorch", "2.0"
)
_vmap_impl = importlib.import_module("torch._functorch.vmap")
_flat_vmap = _require(_vmap_impl, "_flat_vmap", "torch._functorch.vmap", "2.0")
_unwrap_batched = _require(_vmap_impl, "_unwrap_batched", "torch._functorch.vmap", "2.0")
_load_decompositions = _require(
    _vmap_impl, "lazy_load_decompositions", "torch._functorch.vmap", "2.0"
)
_increment_nesting = _require(_functorch, "_vmap_increment_nesting", "torch._C._functorch", "2.0")
_decrement_nesting = _require(_functorch, "_vmap_decrement_nesting", "torch._C._functorch", "2.0")
_remove_batch_dim = _require(_functorch, "_remove_batch_dim", "torch._C._functorch", "2.0")
_function_mode_on = _require(torch._C, "_is_torch_function_mode_enabled", "torch._C", "2.0")
_dispatch_modes = _require(torch._C, "_len_torch_dispatch_stack", "torch._C", "2.0")
_pop_layer = _require(_functorch, "pop_dynamic_layer_stack", "torch._C._functorch", "2.0")
_push_layer = _require(_functorch, "push_dynamic_layer_stack", "torch._C._functorch", "2.0")
_SDP_BACKENDS = ("cudnn", "flash", "mem_efficient", "math", "overrideable")
# (getter, setter, value under sdpa_kernel(MATH)) for each backend this torch has.
_sdp_switches = [
    (
        _require(torch._C, f"_get_{name}_sdp_enabled", "torch._C", "2.0"),
        _require(torch._C, f"_set_sdp_use_{name}", "torch._C", "2.0"),
        name == "math",
    )
    for name in _SDP_BACKENDS
    if name != "overrideable" or hasattr(torch._C, "_set_sdp_use_overrideable")
]


# ---- functorch transforms ---------------------------------------------------------------


def inside_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, ...) is active in this thread."""
    return _peek() is not None


def grad_innermost() -> bool:
    """Whether the innermost ``torch.func`` transform is a grad-like one (not a vmap)."""
    interpreter = _peek()
    return interpreter is not None and interpreter.key() != _VMAP


def vmap_level() -> int | None:
    """The level of the innermost transform if it is a ``vmap``, else ``None``."""
    interpreter = _peek()
    if interpreter is None or interpreter.key() != _VMAP:
        return None
    return interpreter.level()


def unwrap_at(t: Tensor, level: int) -> tuple[Tensor, int | None] | None:
    """``t``'s plain tensor and batch dim if batched at ``level`` (``None`` dim if not
    wrapped at all); ``None`` if it is wrapped otherwise (another level or transform)."""
    if not _is_wrapped(t):
        return t, None
    if not _is_batched(t) or _level_of(t) != level:
        return None
    inner = _unwrap(t)
    if _is_wrapped(inner):
        return None
    return inner, _bdim_of(t)


_is_legacy_batched = _require(_functorch, "is_legacy_batchedtensor", "torch._C._functorch", "2.0")


def batched_at(t: Tensor, level: int) -> bool:
    """Whether ``t``'s outermost ``torch.func`` wrapper batches it at ``level``."""
    return bool(_is_batched(t)) and _level_of(t) == level


def is_legacy_batched(t: Tensor) -> bool:
    """Whether ``t`` is batched by torch's legacy vmap (``torch.autograd.grad(...,
    is_grads_batched=True)``, vectorized ``torch.autograd.functional.jacobian``)."""
    return bool(_is_legacy_batched(t))


def is_wrapped(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (batched or grad-tracking tensor)."""
    return bool(_is_wrapped(t))


def wrapper_level(t: Tensor) -> int | None:
    """The level of ``t``'s outermost ``torch.func`` wrapper, ``None`` if unwrapped."""
    return int(_level_of(t)) if _is_wrapped(t) else None


def unwrap_once(t: Tensor) -> Tensor | None:
    """The tensor a ``torch.func`` wrapper holds, or ``None`` if ``t`` is not wrapped."""
    return _unwrap(t) if _is_wrapped(t) else None


def fully_unwrapped(t: Tensor) -> Tensor:
    """``t`` with every ``torch.func`` wrapper taken off."""
    while _is_wrapped(t):
        t = _unwrap(t)
    return t


def batch_levels(t: Tensor) -> frozenset[int]:
    """The levels of the ``torch.func.vmap`` calls that batch ``t`` (empty outside any)."""
    levels = set()
    while _is_wrapped(t):
        if _is_batched(t):
            levels.add(int(_level_of(t)))
        t = _unwrap(t)
    return frozenset(levels)


def add_batch_dim(t: Tensor, dim: int, level: int) -> Tensor:
    """``t`` handed back to the vmap at ``level`` as a BatchedTensor batched along ``dim``."""
    return _add_batch_dim(t, dim, level)


@functools.lru_cache(maxsize=64)
def _flat_spec(count: int) -> Any:
    """torch's pytree spec of a tuple of ``count`` leaves."""
    return _torch_pytree.tree_flatten(tuple(range(count)))[1]


def vmap_flat(
    func: Callable[..., Any],
    batch_size: int,
    in_dims: list[int | None],
    args: list[Any],
    randomness: str,
) -> Any:
    """``torch.func.vmap(func, tuple(in_dims), randomness=randomness)(*args)`` where every
    arg is a pytree leaf (a tensor, a number, a string, ``None``), each ``in_dims`` entry
    is ``None`` or a non-negative dim, and every mapped arg has ``batch_size`` along it.

    The steps ``torch.func.vmap`` takes once ``_process_batched_inputs`` has flattened
    and checked its arguments (``_flat_vmap``): for such flat arguments the flattening
    gives exactly these lists, and the checks are the caller's. Outside a torch
    function mode its steps are these C calls (its Python wrappers of them only hand
    over to export's pre-dispatch mode); a tensor output is unwrapped as
    ``_unwrap_batched`` unwraps one, any other output by ``_unwrap_batched`` itself.
    Outputs as ``out_dims=0``.
    """
    global _decompositions_loaded
    if _function_mode_on() or _flat_vmap_guards_hooks:
        # A torch function mode may be export's pre-dispatch tracer, which vmap's steps
        # hand over to; older torch disables saved-tensor hooks around them: torch's
        # own _flat_vmap then (its pytree spec of flat args is a tuple of leaves).
        _load_decompositions()
        return _flat_vmap(func, batch_size, in_dims, args, _flat_spec(len(args)), 0, randomness)
    if not _decompositions_loaded:
        _load_decompositions()  # once: it only ever loads them the first time
        _decompositions_loaded = True
    level = _increment_nesting(batch_size, randomness)
    try:
        batched = [
            a if d is None else _add_batch_dim(a, d, level)
            for a, d in zip(args, in_dims, strict=True)
        ]
        out = func(*batched)
        if type(out) is Tensor:
            return _remove_batch_dim(out, level, batch_size, 0)
        return _unwrap_batched(out, 0, level, batch_size, func)
    finally:
        _decrement_nesting()


_decompositions_loaded = False
# torch versions whose _flat_vmap is wrapped in doesnt_support_saved_tensors_hooks.
_flat_vmap_guards_hooks = hasattr(_flat_vmap, "__wrapped__")


class _LowerVmap:
    """``retrieve_current_functorch_interpreter().lower()`` for a vmap interpreter."""

    __slots__ = ("saved",)

    def __enter__(self) -> None:
        self.saved = _pop_layer()

    def __exit__(self, *exc: object) -> None:
        _push_layer(self.saved)


def lower_vmap() -> contextlib.AbstractContextManager:
    """[`lower_transform`][] where the innermost transform is known to be a ``vmap``
    (its ``lower()`` is this pop and push of the layer stack, and nothing else)."""
    return _LowerVmap()


def _set_math_sdpa_only() -> list[bool]:
    saved = [get() for get, _, _ in _sdp_switches]
    for _, set_, value in _sdp_switches:
        set_(value)
    return saved


def _restore_sdpa(saved: list[bool]) -> None:
    for (_, set_, _), value in zip(_sdp_switches, saved, strict=True):
        set_(value)


def lower_transform() -> contextlib.AbstractContextManager:
    """Run what follows one transform level down (a batching rule's own kernels)."""
    return _current_interpreter().lower()


# ---- vmap's silent per-member loop --------------------------------------------------------

# torch keeps the vmap-fallback flag and the MHA fast-path flag process-wide (C++ and
# Python globals, not thread-local). A plain save/set/restore per call lets two threads
# trip each other: the second saves the first's "off" and, leaving last, leaves the
# flags off for good (or the first, leaving, turns them back on under the second). So
# every funcensemble call holds them under one count: the first to enter saves the
# user's values and turns both off, the last to leave restores them.
_switch_lock = threading.Lock()
_switch_holders = 0
_switch_saved: tuple[bool, bool] = (True, True)


class _NoSilentLoops:
    __slots__ = ("math_sdpa", "sdpa")

    def __init__(self, math_sdpa: bool) -> None:
        self.math_sdpa = math_sdpa

    def __enter__(self) -> None:
        global _switch_holders, _switch_saved
        with _switch_lock:
            if _switch_holders == 0:
                _switch_saved = (_fallback_enabled(), torch.backends.mha.get_fastpath_enabled())
                _set_fallback(False)
                torch.backends.mha.set_fastpath_enabled(False)
            _switch_holders += 1
        if self.math_sdpa:
            try:
                self.sdpa = _set_math_sdpa_only()
            except BaseException:
                self._leave()
                raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self.math_sdpa:
                _restore_sdpa(self.sdpa)
        finally:
            self._leave()

    def _leave(self) -> None:
        global _switch_holders
        with _switch_lock:
            _switch_holders -= 1
            if _switch_holders == 0:
                fallback, fastpath = _switch_saved
                _set_fallback(fallback)
                torch.backends.mha.set_fastpath_enabled(fastpath)


def no_silent_vmap_loops(*, math_sdpa: bool = False) -> contextlib.AbstractContextManager:
    """vmap's per-member fallback loop and ``nn.MultiheadAttention``'s fused fast path off
    (and, with ``math_sdpa``, the flags ``sdpa_kernel(SDPBackend.MATH)`` sets).

    Safe across threads and nestable: the flags stay off while any thread is inside,
    and the values they had before the first entry are restored when the last leaves.
    (Being process-wide in torch, they are off for other threads' plain torch calls
    meanwhile too.)
    """
    return _NoSilentLoops(math_sdpa)


_NO_RULE = re.compile(
    r"Batching rule not implemented for (\S+?)\.? We could not generate"
    r"|(\S+) hit the vmap fallback which is currently disabled"
    r"|we do not yet support (\S+?)\. Please file"
    r"|Batching rule not implemented for (\S+?); the fallback path doesn't work on out="
)


def missing_batching_rule(message: str) -> str | None:
    """The operator named by vmap's "no batching rule" error (both wordings torch has
    used since 2.0, e.g. ``aten::_weight_norm``), or ``None`` for another error."""
    match = _NO_RULE.search(message)
    if match is None:
        return None
    found = match.group(1) or match.group(2) or match.group(3) or match.group(4)
    return found.removesuffix(".")


# ---- autograd, hooks, kernels ---------------------------------------------------------------

set_grad_enabled_fast: Callable[[bool], None] = _set_grad
"""``torch.set_grad_enabled`` as a plain call (no context-manager object): restore the
previous value yourself in a ``finally``."""


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_counts(t: Tensor) -> tuple[int, int]:
    """What holds ``t``'s storage: ``_storage_Use_Count`` (one per tensor sharing it)
    and the Python references to its storage object (``out.untyped_storage()`` or
    ``out.storage()`` kept by someone, which the use count does not tell apart)."""
    storage = t.untyped_storage()
    return _use_count(storage._cdata), sys.getrefcount(storage)  # type: ignore[misc]


def _lone_storage_counts() -> tuple[int, int] | None:
    """``_storage_counts`` of a tensor nothing else holds, or None where the use count
    does not count one reference per sharing tensor (torch 2.6 leaves the Python
    storage object out of the count; 2.7 and later count it once)."""
    if _use_count is None:
        return None
    t = torch.empty(1)
    lone = _storage_counts(t)
    view = t.view(1)
    shared = _storage_counts(t)
    del view
    storage = t.untyped_storage()
    held = _storage_counts(t)
    del storage
    if shared[0] != lone[0] + 1 or held[1] <= lone[1] or _storage_counts(t) != lone:
        return None
    return lone


_LONE_STORAGE_COUNTS = _lone_storage_counts()


def storage_held_elsewhere(t: Tensor) -> bool:
    """Whether anything but ``t`` itself (a view, an alias, a tensor autograd saved, a
    storage object someone keeps) holds ``t``'s storage; ``True`` where torch cannot
    tell."""
    if _LONE_STORAGE_COUNTS is None:
        return True
    uses, refs = _storage_counts(t)
    return uses > _LONE_STORAGE_COUNTS[0] or refs > _LONE_STORAGE_COUNTS[1]


def ops_observed() -> bool:
    """Whether something records or intercepts torch's ops in this thread: torch.jit's
    tracer, a torch function mode (export's and ``make_fx``'s tracers, ``with
    torch.device(...)``) or a torch dispatch mode (``make_fx``, ``FakeTensorMode``,
    ``FlopCounterMode``). Work done outside torch's ops, such as NumPy's kernels on a
    tensor's memory, would be invisible to it: a traced graph would leave it out."""
    return _function_mode_on() or _dispatch_modes() > 0 or torch.jit.is_tracing()


def _any_of_the_users(modes: list[Any]) -> bool:
    """Whether any of ``modes`` is defined outside torch and funcensemble."""
    return any(type(m).__module__.partition(".")[0] not in _OWN_MODES for m in modes)


def foreign_function_mode_active() -> bool:
    """Whether a torch function mode of the user's is active in this thread (see
    [`foreign_mode_active`][]): it sees functional calls (``F.layer_norm``), which a
    dispatch mode never sees."""
    return _function_mode_on() and _any_of_the_users(
        torch.overrides._get_current_function_mode_stack()
    )


def foreign_mode_active() -> bool:
    """Whether a torch function or dispatch mode defined outside torch is active in this
    thread: a user's mode may change what an op computes (fake quantization, an adapter
    written as a mode), so it must see the ops each member's own modules call. torch's
    own modes (``with torch.device(...)``, ``make_fx``'s tracer, ``FakeTensorMode``,
    ``FlopCounterMode``) record or count the ops as they compute, and funcensemble's own
    (its rewrites under ``vmap``, CPU autocast's policy) compute what the loop does."""
    return foreign_function_mode_active() or (
        _dispatch_modes() > 0
        and _any_of_the_users(_python_dispatch._get_current_dispatch_mode_stack())
    )


_OWN_MODES = ("torch", __name__.partition(".")[0])


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open in this process."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (the argument is torch >= 2.4's)."""
    if device_type == "meta":
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return False
    except TypeError:  # older torch: CPU and CUDA have their own queries
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return device_type == "cuda" and torch.is_autocast_enabled()


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype ``torch.autocast`` casts to on ``device_type`` (torch >= 2.4's query)."""
    try:
        return torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError):  # older torch
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype()
        return torch.get_autocast_gpu_dtype()


def global_backward_hooks() -> bool:
    """Whether a global ``nn.Module`` backward hook (``register_module_*backward*``) is set."""
    return bool(module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks)


# torch.compiler.disable takes the reason fullgraph=True gives since torch 2.7 or so.
_DISABLE_SAYS = "reason" in inspect.signature(torch.compiler.disable).parameters


def compile_disabled(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """``fn``, run eagerly under ``torch.compile`` (under ``fullgraph=True`` an error,
    which says ``reason`` where torch takes one)."""
    if _DISABLE_SAYS:
        return torch.compiler.disable(fn, reason=reason)
    return torch.compiler.disable(fn)


def compiled_original(fn: Any) -> Any:
    """The function ``torch.compile`` wrapped into ``fn``, or ``None`` if it did not."""
    return getattr(fn, "_torchdynamo_orig_callable", None)


def compiled_module(module: torch.nn.Module) -> str | None:
    """How ``module`` was compiled: ``"torch.compile"`` for the wrapper it returns (an
    ``OptimizedModule``), ``"Module.compile()"`` for a module compiled in place, a
    ``forward`` replaced by ``torch.compile(module.forward)``, else ``None``."""
    if type(module).__module__.startswith("torch._dynamo") and hasattr(module, "_orig_mod"):
        return "torch.compile"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "Module.compile()"
    if hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable"):
        return "torch.compile of its forward"
    return None


def jit_tracing() -> bool:
    """Whether ``torch.jit.trace`` is tracing the current call."""
    return torch._C._get_tracing_state() is not None


def unhooked_forward(module: torch.nn.Module) -> Any:
    """What ``module(...)`` runs when no hook is set: its ``forward``, or under
    ``torch.jit.trace`` the ``_slow_forward`` that records scopes."""
    return module._slow_forward if jit_tracing() else module.forward


def global_forward_hooks() -> bool:
    """Whether a global ``nn.Module`` forward hook or pre-hook is set."""
    return bool(module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks)


def global_module_hooks() -> bool:
    """Whether a global ``nn.Module`` hook (``register_module_forward_hook`` and kin) is set."""
    return bool(
        module_mod._global_forward_hooks
        or module_mod._global_forward_pre_hooks
        or module_mod._global_backward_hooks
        or module_mod._global_backward_pre_hooks
    )


_STOP_RECOMPUTATION = getattr(_checkpoint, "_StopRecomputationError", None)


def ends_recomputation(kind: type[BaseException] | None) -> bool:
    """Whether ``kind`` is ``torch.utils.checkpoint``'s signal that a non-reentrant
    checkpoint's recomputation has what backward needs (its early stop): the forward is
    cut short on purpose, and what it updated in place so far (BatchNorm's running
    statistics) stays updated, as in the loop's own checkpointed modules."""
    return (
        _STOP_RECOMPUTATION is not None
        and kind is not None
        and issubclass(kind, _STOP_RECOMPUTATION)
    )


# ---- the fused Adam kernel ------------------------------------------------------------------


@functools.cache
def fused_adam_devices() -> frozenset[str]:
    """Device types that have ``torch._fused_adam_`` kernels (CPU since torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the lookup: rely on no fused kernel
        return frozenset()
    return frozenset(_get_fused_kernels_supported_devices())


def fused_adam_kernel(*, decoupled: bool) -> Callable[..., Any] | None:
    """``torch._fused_adamw_`` (``decoupled``) or ``torch._fused_adam_``, if torch has it."""
    return getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)


@functools.cache
def fused_adam_takes_tensor_lr() -> bool:
    """Whether ``aten._fused_adam_`` has the ``tensor_lr`` overload (a device tensor lr)."""
    return hasattr(torch.ops.aten._fused_adam_, "tensor_lr")


# ---- distributed checkpoints ----------------------------------------------------------------

DCP_NO_PROCESS_GROUP_WARNING = "torch.distributed is (disabled, )?unavailable or uninitialized"
"""A regex for the start of DCP's warning when it saves or loads without a process group
(torch 2.6 and older say "unavailable or uninitialized", without "disabled, ")."""


def dcp_storage_info() -> type:
    """DCP's ``_StorageInfo``: where in which file a saved entry's bytes lie."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    return dcp_filesystem._StorageInfo


def dcp_storage_meta() -> type | None:
    """DCP's ``StorageMeta`` (what ``read_metadata`` attaches a ``load_id`` to), or
    ``None`` on a torch without it."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    return getattr(dcp_metadata, "StorageMeta", None)


def dcp_private_pickle_names() -> dict[tuple[str, str], Any]:
    """Private classes and functions a DCP ``.metadata`` pickle names, by (module, name)."""
    from torch.serialization import _get_layout  # how torch pickles a layout

    storage_info = dcp_storage_info()
    return {
        (storage_info.__module__, "_StorageInfo"): storage_info,
        ("torch.serialization", "_get_layout"): _get_layout,
    }


def local_shards_wrapper() -> type | None:
    """torch's ``LocalShardsWrapper`` (a rank's chunks with their global offsets, which
    DCP reads through a DTensor holding it), or ``None`` on a torch without it."""
    try:
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    except ImportError:
        return None
    return LocalShardsWrapper


def dcp_save_planner_to_lowest_rank() -> Any:
    """DCP's ``DefaultSavePlanner`` writing each replicated entry from the lowest rank
    that holds it (rather than from the least loaded one), where torch has the option."""
    import inspect

    from torch.distributed.checkpoint import DefaultSavePlanner

    if "dedup_save_to_lowest_rank" in inspect.signature(DefaultSavePlanner).parameters:
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    return None


# ---- torch.nn.utils.parametrize.cached() ---------------------------------------------------


class _OwnParametrizeCache:
    """A fresh ``parametrize`` cache for one call, the caller's put back after it."""

    __slots__ = ("saved",)

    def __enter__(self) -> None:
        self.saved = _parametrize._cache
        _parametrize._cache = {}

    def __exit__(self, *exc: object) -> None:
        _parametrize._cache = self.saved


def own_parametrize_cache() -> contextlib.AbstractContextManager:
    """Inside ``parametrize.cached()``, a cache of the call's own.

    torch caches a parametrized tensor under ``(id(module), name)``: the skeleton's
    entry would hold one member's (or one chunk's, batched) tensor and be read back for
    the next member, chunk or ensemble built from the same members. With a cache of
    its own, a call still computes each parametrization once, and nothing it cached
    outlives it. Outside ``cached()`` (and under ``torch.compile``) nothing changes.
    """
    if not getattr(_parametrize, "_cache_enabled", 0) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _OwnParametrizeCache()


# ---- torch.autograd.grad without its wrapper ------------------------------------------------

_run_backward = torch.autograd.Variable._execution_engine.run_backward


def grads_of(losses: Tensor, inputs: list[Tensor]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(losses.sum(), inputs, allow_unused=True)``.

    The sum's backward hands every loss a gradient of one: here the losses get those
    ones directly, the same values without the sum's op and node. For plain tensors
    outside torch function modes this is the engine call ``torch.autograd.grad`` ends
    in, without its argument handling: about 30 us a call, against some 500 us for a
    whole training step of one small model. Anything else goes through
    ``torch.autograd.grad``.
    """
    ones = torch.ones_like(losses, memory_format=torch.preserve_format)
    if (
        type(losses) is not Tensor
        or _function_mode_on()
        or any(type(t) is not Tensor for t in inputs)
    ):
        return torch.autograd.grad(losses, inputs, grad_outputs=ones, allow_unused=True)
    return _run_backward((losses,), (ones,), False, False, tuple(inputs), True, False)


def same_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` lie in one storage, wherever in it (tensors whose memory
    Python cannot read, a DTensor or another wrapper subclass, count as not)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # "invalid python storage": a wrapper subclass holds no memory
        return False


def overlaps_itself(t: Tensor) -> bool:
    """Whether ``t``'s elements share memory (an expanded view): an in-place write
    into it fails. Unknown layouts count as not overlapping (torch decides then)."""
    return torch._debug_has_internal_overlap(t) == 1


# A shared input changed in place, seen while torch.compile traces. Eagerly, a shared
# input's version counter before and after the call says whether the function changed
# it (_core/vmap.py). A compiled graph cannot read it (a traced ``_version`` is an
# unbacked number, and fails for a torch.func transform's inputs), but Dynamo traces on
# fake tensors whose own version counters move with every in-place op it traces:
# ``torch._dynamo.comptime`` (2.0) runs a function at trace time that reads them.
# Nothing enters the graph; eagerly ``comptime`` does nothing.
_TRACED_VERSIONS = "_funcensemble_traced_versions"


def _fake_of(ctx: Any) -> Tensor | None:
    """The fake tensor Dynamo traces for the local ``t`` of comptime's caller, or
    ``None`` for an inference tensor, which keeps no version counter (Dynamo's fakes of
    inference tensors keep one: a compiled call is stricter than an eager one there).
    Anything unexpected raises, refusing the compile, rather than skipping the check."""
    fake = fully_unwrapped(ctx.get_local("t").as_fake())  # as vmap.py's eager check reads
    return None if fake.is_inference() else fake


def _mark_at_trace(ctx: Any) -> None:
    fake = _fake_of(ctx)
    if fake is not None:
        fake.__dict__.setdefault(_TRACED_VERSIONS, []).append(fake._version)


def _check_at_trace(ctx: Any) -> None:
    fake = _fake_of(ctx)
    if fake is None:
        return
    marks = fake.__dict__.get(_TRACED_VERSIONS)
    if not marks:
        # Marked in another trace: a graph break between the two split the call, and
        # the part in between ran eagerly, unseen here. Refused, never guessed.
        raise RuntimeError(ctx.get_local("split").as_python_constant())
    if fake._version != marks.pop():
        raise ValueError(ctx.get_local("changed").as_python_constant())


def mark_traced_version(t: Tensor) -> None:
    """While ``torch.compile`` traces: note the version of ``t``'s fake tensor."""
    _comptime(_mark_at_trace)


def refuse_traced_change(t: Tensor, changed: str, split: str) -> None:
    """While ``torch.compile`` traces: raise ``ValueError(changed)`` if the ops traced
    since ``mark_traced_version(t)`` changed ``t`` in place (at trace time, so the
    compiled call never runs), ``RuntimeError(split)`` if that mark is in another trace.
    Dynamo hands either on inside an error of its own (``InternalTorchDynamoError``),
    whose message starts with the type's name and ours."""
    _comptime(_check_at_trace)
