"""Mapping a one-member function over the member axis of stacked state."""

import contextlib
import functools
import re
import types
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _torch_compat, _tree
from .._kernels.autocast_policy import CpuAutocastPolicy
from .._kernels.fastpath import fast_call, meta_input_error, refuse_inference_tensors
from .._messages import positive_int
from .._structure import chunk_state as _chunk_state
from . import entry as _entry
from . import in_dims as _in_dims
from . import member_offset as _member_offset
from .call_arguments import arguments_error, refuse_a_module_of_inputs, refuse_an_ensemble
from .fresh_outputs import not_saved, unbatched_copied
from .functional_module import FunctionalModule, check_given, keys_differ
from .in_dims import InDims
from .rollback import rollback_on_error
from .seeding import rng_state, set_rng_state
from .stack import _num_members

Randomness = Literal["different", "same", "error"]

# What to do about operators that ordinary layers call, where the generic advice misleads.
# Inside a FunctionalModule's layers these are rewritten (see _rewrites); these hints are
# for the same calls written in a user's own forward or function.
_HINTS = {
    "aten::as_strided_": (
        "It is usually F.adaptive_avg_pool2d/3d to an output of size 1 on a "
        "channels_last tensor, called in your own code (nn.AdaptiveAvgPool layers of a "
        "stacked module are handled): write x.mean((-2, -1), keepdim=True) (the same "
        "values), or call x.contiguous() before pooling."
    ),
}
_HINTS["aten::rrelu"] = _HINTS["aten::rrelu_with_noise"] = (
    "It is nn.RReLU / F.rrelu: in eval mode RReLU is nn.LeakyReLU((lower + upper) / 2)."
)
_HINTS["aten::embedding_bag"] = _HINTS["aten::embedding_bag.padding_idx"] = (
    "It is nn.EmbeddingBag / F.embedding_bag (with or without padding_idx): use "
    "nn.Embedding and reduce over the bag yourself (e.g. .sum(-2) or .mean(-2))."
)
_HINTS["aten::bilinear"] = (
    "It is nn.Bilinear / F.bilinear: write it as "
    "torch.einsum('...i,oij,...j->...o', x1, weight, x2) + bias (the same values)."
)
_HINTS["aten::_weight_norm"] = _HINTS["aten::_weight_norm_interface"] = (
    "It is torch._weight_norm (as in torch.nn.utils.weight_norm): use "
    "torch.nn.utils.parametrizations.weight_norm, which funcensemble handles, or write "
    "v * (g / torch.linalg.vector_norm(v, dim=<all dims but dim>, keepdim=True))."
)


def _no_silent_loops(on_cpu: bool) -> contextlib.AbstractContextManager:
    """Forbid vmap's per-element fallback loop for one call, and avoid its usual causes.

    Without this, ops lacking a batching rule silently run one member at a time. Two
    such ops sit inside ordinary attention layers, so they are routed around:
    ``nn.MultiheadAttention``'s fused inference fast path, and the CPU flash-attention
    kernel of ``scaled_dot_product_attention`` (its math backend batches fine).
    """
    if torch.compiler.is_compiling():
        return _traced_switches(on_cpu)
    return _torch_compat.no_silent_vmap_loops(math_sdpa=on_cpu)


@contextlib.contextmanager
def _traced_switches(on_cpu: bool) -> Iterator[None]:
    # Dynamo cannot trace the global fallback/fast-path switches, but it does trace
    # sdpa_kernel: without it the CPU flash kernel would loop over members.
    with sdpa_kernel(SDPBackend.MATH) if on_cpu else contextlib.nullcontext():
        yield


def _cpu_autocast_policy(where: str) -> contextlib.AbstractContextManager:
    """CPU autocast's per-op policy for one call, while CPU autocast is on (see
    ``_kernels/autocast_policy.py``); a call without it pays one check."""
    if not _torch_compat.autocast_enabled("cpu") or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return CpuAutocastPolicy(where)


def _buffer_with_history(
    error: Exception, buffers: Any, chunked: bool, where: str
) -> Exception | None:
    """A chunked call whose forward wrote a differentiable value into a buffer in place
    (``self.snap.copy_(param * 2)``): the first chunk's write gave the stacked buffer a
    graph (it is no longer a leaf), and the next chunk's write fails inside torch. That
    graph is cut (the ensemble must not hold one) and the error says what to change.
    Leaves (a buffer the caller made require grad) and views are left as they are."""
    if not chunked or "leaf Variable that requires grad" not in str(error):
        return None
    if not isinstance(buffers, dict):
        return None
    names = [
        k
        for k, v in buffers.items()
        if isinstance(v, Tensor) and v.grad_fn is not None and not v._is_view()
    ]
    if not names:
        return None
    for name in names:
        buffers[name].detach_()
    return ValueError(
        f"{where}: the forward wrote a value with autograd history into the buffer "
        f"`{names[0]}` in place (e.g. buffer.copy_(param * 2)), which one chunk after "
        "another cannot write (expected buffers updated from detached values). Write a "
        "detached value (buffer.copy_(value.detach())), as the loop's members need too "
        "to backward more than once; the members of the chunks that ran keep their write."
    )


# Types torch's pytree takes as leaves: arguments of only these are already flat.
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def _all_leaves(args: tuple[Any, ...], dims: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every argument and keyword value is a pytree leaf, with an int or ``None``
    member dim, outside ``torch.compile`` (whose tracing of ``torch.func.vmap`` we keep)."""
    return (
        all(type(a) in _LEAF_TYPES for a in args)
        and all(type(v) in _LEAF_TYPES for v in kwargs.values())
        and all(d is None or type(d) is int for d in dims)
        and not torch.compiler.is_compiling()
    )


def _on_cpu(params: Any, buffers: Any) -> bool:
    for tree in (params, buffers):
        for t in tree.values():
            return t.is_cpu
    return True


def _explain(error: RuntimeError | ValueError, randomness: str, where: str) -> Exception | None:
    message = str(error)
    op = _torch_compat.missing_batching_rule(message)
    if op is not None and op.endswith(".out"):
        return RuntimeError(
            f"{where}: the operator {op} (a call with out=) has no vmap batching rule, "
            "so the members cannot run as one vectorized call (expected in-place updates "
            "written without out=, got a call writing into out=). Write "
            "buf.copy_(torch.maximum(buf, value)) for torch.maximum(buf, value, out=buf), "
            "or an in-place method (buf.add_(value) for torch.add(buf, value, out=buf)): "
            "the same values, and they batch."
        )
    if op is not None:
        return RuntimeError(
            f"{where}: the operator {op} has no vmap batching rule, so the members "
            "cannot run as one vectorized call (funcensemble does not silently loop over "
            "them). "
            + _HINTS.get(
                op,
                "Replace the layer or call that uses it with operators that batch "
                "(see the how-to page 'Unsupported layers'), or loop over the members "
                "yourself.",
            )
        )
    if "must only return Tensors" in message:
        found = re.search(r"got type <class '([^']+)'>", message)
        kind = found.group(1) if found else "non-tensor"
        return ValueError(
            f"{where}: the function returned a {kind} among its outputs (expected tensors "
            "only: every output is stacked along a new member axis, and a Python value "
            "or None has none). nn.MultiheadAttention(need_weights=False) returns (out, "
            "None): keep [0] of it in the member's forward (or in a small wrapper module); "
            "with value_and_grad, return the loss, and any aux, as tensors."
        )
    if "calling .item() on a Tensor" in message:
        return RuntimeError(
            f"{where}: the function calls .item() (or float(), int(), bool()) on a tensor, "
            "which holds one value per member here, not one Python number. Keep the value "
            "a tensor (compute with it, or return it as aux with has_aux=True and read it "
            "after the call). Torch's message: " + message.splitlines()[0]
        )
    if "data-dependent control flow" in message:
        return RuntimeError(
            f"{where}: the function branches on a tensor's value (an `if` on a tensor, "
            "torch.any(...), .item(), a data-dependent shape), which one vectorized call "
            "cannot do for every member at once (loss modules such as nn.GaussianNLLLoss "
            "check their inputs this way). Compute both branches and pick with "
            "torch.where, or move the check out of the member's forward or loss (for "
            "F.gaussian_nll_loss, write the loss out as the how-to page 'Regression: predicted "
            "variances and the mixture' does). Torch's message: " + message.splitlines()[0]
        )
    in_place = "inplace arithmetic(self, *extra_args) is not possible" in message
    if in_place and _torch_compat.inside_transform():
        return RuntimeError(
            f"{where}: forward changes in place a tensor that one of the vmap levels "
            "around it does not batch (expected in-place changes of tensors batched at "
            "every level, got one shared at some level): inside a torch.func transform of "
            "your own, a buffer the forward updates, such as BatchNorm's running "
            "statistics in train mode, is shared by that transform's batch entries "
            "(torch.func.vmap refuses that for one plain module too); an input shared by "
            "all members and changed in place (nn.Dropout(inplace=True) on it) is shared "
            "by the members. Call the members in eval mode inside your transform, or call "
            "the ensemble once per entry of your batch; clone a shared input at the start "
            "of forward. Torch's "
            "message: " + message.splitlines()[0]
        )
    if in_place:
        return RuntimeError(
            f"{where}: forward changes in place a tensor that all members share (an "
            "input, or one made from inputs alone) with a value that differs between "
            "members, such as nn.Dropout(inplace=True) or x.mul_(...) applied to a "
            "shared input (expected in-place changes of per-member tensors only: in the "
            "loop each member would change the one input in turn). Clone the input at "
            "the start of forward, or use the layer without inplace. Torch's message: "
            + message.splitlines()[0]
        )
    if "randomness" in message and randomness == "error":
        return RuntimeError(
            f"{where}: the model draws random numbers (e.g. Dropout in train mode) but "
            "randomness='error'. Pass randomness='different' for independent draws per "
            "member, randomness='same' to share one draw across members, or call .eval()."
        )
    if "same randomness with a batched tensor" in message:
        return RuntimeError(
            f"{where}: randomness='same' shares one draw among all members, but this random "
            "op samples from a tensor that differs between the members, such as "
            "torch.bernoulli(p) of a layer's output (expected random ops whose inputs all "
            "members share, got one of per-member values). Pass randomness='different' "
            "for independent draws per member, or draw the random numbers outside the "
            "members and give them as an input. Torch's "
            "message: " + message.splitlines()[0]
        )
    return None


def vmap(
    fn: Callable[..., Any],
    in_dims: InDims = None,
    *,
    randomness: Randomness = "different",
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """Map a one-member function over all members of stacked parameters and buffers.

    ``fn(params, buffers, *args, **kwargs)`` is written for ONE member (e.g. the
    ``fmodel`` from [`stack`][funcensemble.stack], or a loss built on it). The result
    takes stacked ``params`` and ``buffers`` (member axis first) and returns ``fn``'s
    outputs stacked along a new leading member axis, as a pytree if ``fn`` returns one.
    Buffers that ``fn`` updates in place (BatchNorm running statistics in train mode)
    are updated for every member in the stacked tensors. If the call raises, the running
    statistics that the normalization layers of a
    [`FunctionalModule`][funcensemble.FunctionalModule] updated in ``buffers`` are put
    back as they were (a custom module's own in-place buffer updates are not).

    Args:
        fn: The one-member function.
        in_dims: How the positional arguments after ``params`` and ``buffers`` are
            split over members: ``None`` (shared by all members), an int (the member
            dim of every mapped tensor), or a tuple with one entry per argument (each
            ``None``, an int, or a pytree of those matching the argument; a dict
            entry names the argument's leaves by key, in any key order). Keyword
            arguments are always shared. Argument pytrees are read as optree reads
            them: tuples, lists, dicts, namedtuples, ``OrderedDict``, ``deque``; any
            other object is one leaf. Calls from several threads at once are safe
            (off the fast path, calls of one ensemble take turns: each borrows its one
            skeleton module), except chunked calls of one ensemble whose ``forward``
            changes the module's own attributes (a counter): a chunk replays them
            from its call's start, which another thread's call may have moved. An
            ``Ensemble``'s own readers (``parameters()``, ``state_dict()``,
            ``stacked_params()``, ``len``, ``member``, ``select``, ...) wait for a
            call running in another thread (so a forward that waits for another
            thread reading its own ensemble never returns: read before the call);
            reading ``ens.stacked``'s submodules directly, or ``parameters()`` of a
            ``HeteroEnsemble`` or of a module holding the ensemble, meanwhile sees
            the call's borrowed tensors: build optimizers and read tensors between
            calls.
        randomness: ``"different"``: each member draws its own random numbers
            (independent dropout masks); ``"same"``: one draw shared by all members;
            ``"error"``: refuse random operations.
        chunk_size: Map at most this many members at a time, bounding peak memory
            at the cost of speed. ``None`` maps all members at once.

    Returns:
        The mapped function ``(params, buffers, *args, **kwargs) -> outputs``.

    Raises:
        ValueError: A per-member argument whose size along its member dim is not N,
            or a malformed ``in_dims``/``chunk_size``/``randomness``.
        TypeError: A non-callable ``fn``, or ``in_dims``/``chunk_size`` of a wrong type.
        RuntimeError: An operator with no vmap batching rule (named in the message).

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> fe.vmap(fmodel)(params, buffers, torch.randn(10, 3)).shape
        torch.Size([4, 10, 2])
        >>> xs = torch.randn(4, 10, 3)  # one batch per member
        >>> fe.vmap(fmodel, in_dims=(0,))(params, buffers, xs).shape
        torch.Size([4, 10, 2])
    """
    check_options("vmap", fn, randomness, chunk_size)
    _in_dims.check_type("vmap", in_dims)
    run = mapped_call(fn, randomness, chunk_size, where="vmap")

    def mapped(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
        n = _num_members("vmap", params, buffers, computing=True)
        return run(params, buffers, args, kwargs, _in_dims.per_argument(in_dims, args, n))

    if isinstance(fn, types.FunctionType) or not torch.compiler.is_compiling():
        # (A FunctionalModule's missing __name__ raises an AttributeError that Dynamo
        # cannot trace: fe.vmap(fmodel) built inside a fullgraph function failed.)
        mapped = functools.wraps(fn)(mapped)

    return mapped


def check_options(
    where: str, fn: Any, randomness: Any, chunk_size: Any, *, name: str = "fn"
) -> None:
    """Refuse a non-callable ``fn`` (the argument ``name``) or a malformed
    ``randomness``/``chunk_size``."""
    if not callable(fn):
        raise TypeError(
            f"{where}: {name} is not callable (expected a callable, got "
            f"{type(fn).__name__}). Pass the function to map over members."
        )
    refuse_an_ensemble(where, name, fn)
    refuse_a_module_of_inputs(where, name, fn)
    if randomness not in ("different", "same", "error"):
        raise ValueError(
            f"{where}: randomness must be 'different', 'same' or 'error' (expected one of "
            f"those, got {randomness!r}). Pass one of those three."
        )
    if chunk_size is not None:
        positive_int(where, "chunk_size", chunk_size, or_none=True)


# A shared input: its positional index or keyword, whether it is a tensor inside that
# argument, and the tensor. Named only in an error (see _what).
Shared = tuple[int | str, bool, Tensor]


def _shared_inputs(
    args: tuple[Any, ...], dims: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Shared]:
    """The tensors every member shares: the tensor arguments not mapped, and the tensors
    inside other arguments (dicts, tuples, lists) on which the argument's in_dims puts
    ``None``."""
    out: list[Shared] = []

    def add(key: int | str, a: Any, dim: Any, index: int) -> None:
        if isinstance(a, Tensor):
            if dim is None:
                out.append((key, False, a))
            return
        if isinstance(dim, int) or isinstance(a, (str, int, float, bool)) or a is None:
            return  # mapped as a whole, or no tensor in it
        if dim is None:  # every leaf shared (the pytree walk of leaf_dims, which
            # Dynamo cannot trace for a None prefix, is not needed)
            leaves = _tree.flatten(a)[0]
            flat = [None] * len(leaves)
        else:
            leaves, flat = _in_dims.leaf_dims(index, a, dim)
        for leaf, d in zip(leaves, flat, strict=True):
            if d is None and isinstance(leaf, Tensor):
                out.append((key, True, leaf))

    for i, (a, d) in enumerate(zip(args, dims, strict=True)):
        add(i, a, d, i)
    for k, a in kwargs.items():
        add(k, a, None, 0)
    return out


# Eagerly, the version counters are read by these two. Called from a ``run`` that
# Dynamo runs eagerly (it cannot resume a graph break inside run's ``with`` block, so it
# runs the whole frame eagerly, and compiles the frames run calls, one by one), they
# must not be compiled themselves, where a version counter is traced: compile_disabled
# (about 0.3 µs a call each on torch 2.13, 0.2 µs on 2.14, eagerly).
def _versions(shared: list[Shared]) -> list[int]:
    """The shared tensors' version counters now (-1 for an inference tensor, made under
    ``torch.inference_mode()``, which keeps none: documented in inputs.md). Read on the
    plain tensor inside any ``torch.func`` wrapper of the caller's own (a vmap over
    seeds): an in-place op through the wrapper moves the plain tensor's counter only."""
    out = []
    for _, _, tensor in shared:
        plain = _torch_compat.fully_unwrapped(tensor)
        out.append(-1 if plain.is_inference() else plain._version)
    return out


def _first_changed(shared: list[Shared], versions: list[int]) -> int | None:
    """The index of the first shared tensor whose version counter moved, or ``None``."""
    for i, (_, _, tensor) in enumerate(shared):
        if versions[i] >= 0 and _torch_compat.fully_unwrapped(tensor)._version != versions[i]:
            return i
    return None


_versions = _torch_compat.compile_disabled(_versions, "reads version counters, eagerly")
_first_changed = _torch_compat.compile_disabled(_first_changed, "reads version counters, eagerly")


def _argument(key: int | str) -> str:
    """An argument's name in messages: its keyword, or its position."""
    return f"keyword argument {key!r}" if isinstance(key, str) else f"positional argument {key}"


def _what(key: int | str, inside: bool) -> str:
    """A shared input's name in messages."""
    return f"a tensor inside its {_argument(key)}" if inside else f"its {_argument(key)}"


def _refuse_meta_inputs(
    where: str, params: Any, buffers: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse an input on the meta device given members that hold values: vmap runs it
    with them and returns uninitialized memory (and BatchNorm's statistics updated from
    it), where the loop raises."""
    first = next(iter(params.values()), None) if isinstance(params, dict) else None
    if first is None and isinstance(buffers, dict):
        first = next(iter(buffers.values()), None)
    if not isinstance(first, Tensor) or first.is_meta:
        return
    for key, a in (*enumerate(args), *kwargs.items()):
        leaves = [a] if isinstance(a, Tensor) else _tree.flatten(a)[0]
        if any(isinstance(t, Tensor) and t.is_meta for t in leaves):
            raise RuntimeError(meta_input_error(where, _argument(key), first.device))


def _check_unchanged(shared: list[Shared], versions: list[int] | None, where: str) -> None:
    """Refuse a call that modified an input shared by all members in place.

    The loop's members modify it in turn, each seeing the changes of the members
    before it; here the one call modifies it once for all of them. ``versions``: the
    version counters ``_versions`` read before the call, or ``None`` in a call that
    Dynamo traces (``torch.compile``, a strict ``torch.export``), where the fake
    tensors' counters are compared while tracing, before the compiled call ever runs
    (``_torch_compat.refuse_traced_change``).
    """
    if versions is None:
        for key, inside, tensor in shared:
            _torch_compat.refuse_traced_change(
                tensor,
                _changed_message(where, key, inside, compiled=True),
                _split_message(where, key, inside),
            )
        return
    i = _first_changed(shared, versions)
    if i is not None:
        key, inside, _ = shared[i]
        # (Traced by a non-strict torch.export: on fake tensors, the input is as it was.)
        traced = torch.compiler.is_compiling()
        raise ValueError(_changed_message(where, key, inside, compiled=traced))


def _changed_message(where: str, key: int | str, inside: bool, *, compiled: bool) -> str:
    return (
        f"{where}: the function modified {_what(key, inside)}, an input shared by "
        "all members, "
        "in place (expected inputs left as they are: the loop's members would "
        "each modify it in turn, every member seeing the changes of those before "
        "it, where one vectorized call modifies it once). "
        + (
            "Refused while torch.compile or torch.export traced the call: the input is as it was. "
            if compiled
            else "The input has been modified once. "
        )
        + "Clone it at the start of forward (x = x.clone()), or "
        "avoid the in-place op (e.g. nn.ReLU(inplace=False) on the input)."
    )


def _split_message(where: str, key: int | str, inside: bool) -> str:
    return (
        f"{where}: torch.compile split the call at a graph break, so whether the "
        f"function modified {_what(key, inside)}, an input shared by all members, in "
        "place cannot be checked (expected the call traced whole, or run eagerly, "
        "got it traced in parts). Call it eagerly, or compile it without graph breaks."
    )


def mapped_call(
    fn: Callable[..., Any],
    randomness: Randomness,
    chunk_size: int | None,
    *,
    where: str,
    fresh: bool = True,
    saved: bool = True,
) -> Callable[[Any, Any, tuple[Any, ...], dict[str, Any], tuple[Any, ...]], Any]:
    """``fn`` mapped over members, taking ``(params, buffers, args, kwargs, dims)``.

    The layer under the public entry points: options checked by
    [`check_options`][], ``dims`` by ``_in_dims.per_argument``, and the stacked state by
    ``_num_members``; nothing is checked again here. Errors name ``where``, the entry
    point the user called. ``fresh=False``: the outputs come back as the call made
    them, for a caller that copies or checks them itself (see ``fresh_outputs``);
    ``saved=False``: outputs an op saved are not copied (``not_saved``'s ``saved``).
    """

    def one_member(params: Any, buffers: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        out = fn(params, buffers, *args, **kwargs)
        return unbatched_copied(out) if fresh else out

    skeleton = fn.skeleton if isinstance(fn, FunctionalModule) else None

    def run(
        params: Any,
        buffers: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dims: tuple[Any, ...],
    ) -> Any:
        if skeleton is not None and chunk_size is None:
            if not torch.compiler.is_compiling() and keys_differ(fn, params, buffers):
                check_given(fn, params, buffers, where)
            fast = fast_call(skeleton, params, args, kwargs, dims)
            if fast is not None:
                return fast if torch.compiler.is_compiling() else not_saved(fast)
        if not torch.compiler.is_compiling():
            _refuse_meta_inputs(where, params, buffers, args, kwargs)
            refuse_inference_tensors(where, params)
        # params and buffers (flat dicts of tensors, checked above us) go in as
        # positional tensors: torch.func.vmap's Python pytree walk of two dicts costs
        # more than a small ensemble's whole forward.
        names, n_params = [*params, *buffers], len(params)
        n_state = len(names)
        state = [*params.values(), *buffers.values()]
        if chunk_size is None and _all_leaves(args, dims, kwargs):
            # Every argument a leaf too: the inputs are already what vmap's own
            # flattening would make of them, and checked, so vmap's one call is made
            # directly (see _torch_compat.vmap_flat), without its pytree walk.
            def flat_leaves(*flat: Any) -> Any:
                p = dict(zip(names[:n_params], flat[:n_params], strict=True))
                b = dict(zip(names[n_params:], flat[n_params:n_state], strict=True))
                return one_member(p, b, flat[n_state:], kwargs)

            flat_dims = [0] * n_state
            for arg, dim in zip(args, dims, strict=True):
                flat_dims.append(dim if dim is None or dim >= 0 else dim + arg.dim())

            def call() -> Any:
                n = state[0].shape[0]
                return _torch_compat.vmap_flat(
                    flat_leaves, n, flat_dims, [*state, *args], randomness
                )

        else:
            chunks = [0]  # torch.func.vmap maps the chunks in order, one call each
            device = state[0].device if state else torch.device("cpu")
            draws: list[Any] = [None]

            def flat_member(*flat: Any) -> Any:
                p = dict(zip(names[:n_params], flat[:n_params], strict=True))
                b = dict(zip(names[n_params:], flat[n_params:n_state], strict=True))
                if chunk_size is None or torch.compiler.is_compiling():
                    return one_member(p, b, flat[-2], flat[-1])
                start = chunks[0] * chunk_size  # for messages naming a member
                if chunks[0] and replay is not None:  # each chunk from the call's attributes
                    replay.next_chunk()
                if randomness == "same":
                    # One draw shared by all members: every chunk replays it. torch's
                    # chunked vmap replays the CPU generator only; a CUDA ensemble's
                    # dropout draws from its device's (as fe.value_and_grad replays it).
                    if chunks[0]:
                        set_rng_state(device, draws[0])
                    else:
                        draws[0] = rng_state(device)
                chunks[0] += 1
                with _member_offset.starting_at(start):
                    out = one_member(p, b, flat[-2], flat[-1])
                # After each chunk: a shared input changed in place is refused once it
                # has been changed once, not once per chunk.
                _check_unchanged(shared, versions, where)
                return out

            vmapped = torch.func.vmap(
                flat_member,
                in_dims=(*[0] * n_state, dims, None),
                randomness=randomness,
                chunk_size=chunk_size,
            )

            replay: Any = None

            def call() -> Any:
                nonlocal replay
                chunks[0] = 0
                if chunk_size is None or torch.compiler.is_compiling():
                    return vmapped(*state, args, kwargs)
                with _chunk_state.chunked(where) as replay:
                    return vmapped(*state, args, kwargs)

        shared = _shared_inputs(args, dims, kwargs)
        versions: list[int] | None = None
        if not torch.compiler.is_dynamo_compiling():
            # Eagerly, and under a non-strict torch.export, which runs this Python on
            # fake tensors whose version counters can be read: compared after the call.
            versions = _versions(shared)
        else:
            for _, _, tensor in shared:
                _torch_compat.mark_traced_version(tensor)
        # (Not while compiling: Dynamo traces no context variable; messages are eager's.)
        token = (
            None
            if torch.compiler.is_compiling()
            else _entry.enter(where, forward_only=skeleton is not None)
        )
        try:
            # A call that raises leaves the buffers as they were (see _rollback).
            with (
                rollback_on_error(buffers, params),
                _no_silent_loops(_on_cpu(params, buffers)),
                _cpu_autocast_policy(where),
            ):
                out = call()
                _check_unchanged(shared, versions, where)
                if torch.compiler.is_compiling() or not fresh:
                    return out
                # An output may be a member's parameter, buffer or input itself.
                return not_saved(out, params, buffers, args, kwargs, saved=saved)
        except (RuntimeError, ValueError) as error:
            clear = _explain(error, randomness, where) or _buffer_with_history(
                error, buffers, chunk_size is not None, where
            )
            if clear is None:
                raise
            # Keep the frames down to the offending op, but not torch's internal wording.
            raise clear.with_traceback(error.__traceback__) from None
        except TypeError as error:
            unfit = arguments_error(where, fn, args, kwargs)
            if unfit is None:
                raise
            raise unfit.with_traceback(error.__traceback__) from None
        finally:
            if token is not None:
                _entry.leave(token)

    return run
