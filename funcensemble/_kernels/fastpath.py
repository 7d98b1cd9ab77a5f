"""Direct batched kernels for plain MLPs, used instead of ``vmap`` where they apply.

Under ``vmap`` a batched ``F.linear`` becomes ``bmm`` plus separate bias passes and
copies. For the most common ensemble architecture, a chain of ``nn.Linear`` layers and
elementwise activations, running ``torch.baddbmm`` on the stacked weights directly
folds the bias into the GEMM and skips vmap's dispatch entirely. Anything this module
does not recognise exactly (subclasses, hooks, parametrizations, dropout in train
mode, other layers) returns ``None`` and the caller takes the general ``vmap`` path.
"""

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .. import _torch_compat
from . import linear_act as _linear_act
from . import mlp_member_op as _mlp_member_op
from . import mlp_op as _mlp_op
from . import tanh as _tanh
from . import torch_functions as _torch_functions
from . import workspace as _workspace

_ELEMENTWISE: dict[type, Callable[[nn.Module, Tensor], Tensor]] = {
    nn.Identity: lambda m, x: x,
    nn.Tanh: lambda m, x: torch.tanh(x),
    nn.ReLU: lambda m, x: torch.relu(x),
    nn.Sigmoid: lambda m, x: torch.sigmoid(x),
    nn.SiLU: lambda m, x: F.silu(x),
    nn.Mish: lambda m, x: F.mish(x),
    nn.GELU: lambda m, x: F.gelu(x, approximate=m.approximate),
    nn.LeakyReLU: lambda m, x: F.leaky_relu(x, m.negative_slope),
    nn.ELU: lambda m, x: F.elu(x, m.alpha),
    nn.Softplus: lambda m, x: F.softplus(x, m.beta, m.threshold),
}

# A step is (module, weight name, bias name) for a Linear, or (module, None, None).
Plan = list[tuple[nn.Module, str | None, str | None]]


# The forward of each class the fast path runs without calling it, as torch defines it:
# a class whose forward was replaced (nn.Linear.forward = ..., a patch in a notebook,
# before or after this import) runs on the general path, which calls it. So do calls
# of a class-wide wrapper of nn.Module.__call__, and calls while a function those
# forwards call is replaced (see _torch_functions).
_TORCH_FORWARD = {
    kind: kind.forward
    for kind in (nn.Sequential, nn.Linear, nn.Dropout, *_ELEMENTWISE)
    if _torch_functions.torch_own(kind.forward)
}


def _has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _in_place_is_safe(module: nn.Module, steps: Plan) -> bool:
    """Whether the loop's backward runs through ``module`` applied in place, so the
    fast path's out-of-place op gives its numbers.

    Only on the fresh output of a Linear (whose backward does not read it): on the
    input itself the chain would write the caller's tensor, and on an activation's
    output (``Tanh`` then ``ReLU(inplace=True)``) it overwrites what that activation
    saved, which the loop's backward refuses ("modified by an inplace operation").
    Torch refuses in place backward of ``LeakyReLU`` with a negative slope and ``ELU``
    with a negative ``alpha`` anywhere.
    """
    if not steps or steps[-1][1] is None:
        return False
    if isinstance(module, nn.LeakyReLU):
        return module.negative_slope >= 0
    if isinstance(module, nn.ELU):
        return module.alpha >= 0
    return True


def _visit(module: nn.Module, prefix: str, steps: Plan) -> bool:
    if _has_hooks(module) or "forward" in module.__dict__:
        # A forward set on the instance (module.forward = ..., as accelerate's hooks
        # and ad-hoc patches do) is not the class's: the general path calls it.
        return False
    kind = type(module)
    if _TORCH_FORWARD.get(kind) is not kind.forward or not (
        _torch_functions.module_calls_are_torch_own(kind)
    ):
        return False
    if kind is nn.Sequential:
        # Sequential.forward runs _modules in order, repeats included (named_children
        # would skip a module instance used twice).
        for name, child in module._modules.items():
            if child is None or not _visit(child, f"{prefix}{name}.", steps):
                return False
        return True
    if kind is nn.Linear:
        bias = f"{prefix}bias" if module.bias is not None else None
        steps.append((module, f"{prefix}weight", bias))
        return True
    if kind in _ELEMENTWISE or kind is nn.Dropout:
        if getattr(module, "inplace", False) and not _in_place_is_safe(module, steps):
            # The general path runs it as written: it fails as the loop's backward does.
            return False
        steps.append((module, None, None))
        return True
    return False


def plan(skeleton: nn.Module) -> Plan | None:
    """The layer chain of ``skeleton`` if it is a plain MLP, else ``None``.

    Recomputed on every call (about 10 us, under 0.1% of a call of the S benchmark
    workload): hooks, train/eval flags and submodules may change between calls, and
    a cache keyed on shapes, dtypes and devices would not see a hook added or a layer
    replaced; checking for those costs what planning does.
    """
    steps: Plan = []
    if (
        not _visit(skeleton, "", steps)
        or not any(w for _, w, _ in steps)
        or not _torch_functions.calls_unchanged([type(m) for m, _, _ in steps])
    ):
        return None
    return steps


# Activations autograd differentiates from their output alone: applied in place to the
# fresh output of the layer before them, which saves one activation-sized tensor per
# layer (the layer's backward does not need its own output).
_IN_PLACE: dict[type, Callable[[Tensor], Tensor]] = {
    nn.Tanh: torch.tanh_,
    nn.Sigmoid: torch.sigmoid_,
    nn.ReLU: torch.relu_,
}


def _activate_fresh(kind: type, h: Tensor) -> Tensor:
    """``_IN_PLACE[kind](h)``, with a CPU float32 ``Tanh`` computed as the kept-buffer
    layers compute it (``_tanh``) wherever they could run instead (eager, outside other
    transforms): a member's numbers do not depend on which of the two runs it."""
    if (
        kind is not nn.Tanh
        or not _tanh.replaces(h)  # False under torch.compile, checked first there
        or _torch_compat.inside_transform()
        or _torch_compat.forward_ad_active()
    ):
        return _IN_PLACE[kind](h)
    # Without grad, no autograd.Function: its overhead is a third of a small layer's.
    return _tanh.FastTanh.apply(h) if torch.is_grad_enabled() else _tanh.tanh_(h)


def width_error(where: str, weight: str, shape: tuple[int, ...], got: int, *, first: bool) -> str:
    """The message for a Linear (weight ``weight``, one member's ``shape``) fed ``got``
    input features; ``first``: the layer the input itself reaches."""
    layer = weight.removesuffix("weight").rstrip(".") or "(the module itself)"
    head = f"{where}: layer `{layer}` (Linear, weight `{weight}` of shape {shape} per member)"
    expected = shape[-1]
    if first:
        return (
            f"{head} expects {expected} input features (expected an input of shape "
            f"(..., {expected}), got (..., {got})). Pass inputs whose last dim is {expected}."
        )
    return (
        f"{head} expects {expected} input features, but is given {got}. Each member's own "
        "module fails the same way: fix the width of what feeds it."
    )


def check_widths(where: str, steps: Plan, params: dict[str, Tensor], n: int, width: int) -> None:
    """Check each Linear's stacked shapes, and its ``in_features`` against the width
    reaching it, before any GEMM.

    Otherwise a wrong input width surfaces as the shapes of our internal matrix
    products (``(20x3 and 4x10)``), which name neither the input nor the layer; and a
    tensor assigned to the stacked module with another shape (a ``[1, out]`` or one
    member's ``[out]`` bias) would broadcast over the members without a word.
    """
    first = True
    for _, weight, bias in steps:
        if weight is None:
            continue
        w = params[weight]
        if w.dim() != 3 or w.shape[0] != n:
            raise ValueError(_stacked_shape_error(where, weight, tuple(w.shape), n, "[N, out, in]"))
        if w.shape[-1] != width:
            raise ValueError(width_error(where, weight, tuple(w.shape[1:]), width, first=first))
        width = w.shape[-2]
        first = False
        if bias is not None and params[bias].shape != (n, width):
            got = tuple(params[bias].shape)
            raise ValueError(_stacked_shape_error(where, bias, got, n, f"[N, {width}]"))


def _stacked_shape_error(where: str, name: str, got: tuple[int, ...], n: int, want: str) -> str:
    return (
        f"{where}: stacked tensor `{name}` has shape {got} (expected {want} with N={n}: "
        "the member axis first, then one member's shape as the members were built). A "
        "tensor of another shape would broadcast over the members. Keep the shapes the "
        "ensemble was built with; to change them, build a new ensemble from modules of "
        "the new shapes."
    )


def check_dtype(where: str, steps: Plan, params: dict[str, Tensor], x: Tensor) -> None:
    """Refuse an input of another dtype than the first Linear's weight, as the loop's
    ``F.linear`` does, but naming the input and the layer (not our matrix products)."""
    weight = next(w for _, w, _ in steps if w is not None)
    want = params[weight].dtype
    if x.dtype != want:
        layer = weight.removesuffix("weight").rstrip(".") or "(the module itself)"
        got, wanted = str(x.dtype).removeprefix("torch."), str(want).removeprefix("torch.")
        raise RuntimeError(  # the class of the loop's own error
            f"{where}: the input's dtype is {got}, but layer `{layer}` (Linear) has {wanted} "
            f"weights (expected a {wanted} input, got {got}), as each member's own "
            f"module requires. Convert the input (x.to(torch.{wanted})) or the members."
        )


def meta_input_error(where: str, what: str, device: torch.device) -> str:
    """The message for an input on the meta device given members that hold values:
    vmap's products would return uninitialized memory on the members' device."""
    return (
        f"{where}: {what} is on the meta device, which holds no values, but the members' "
        f"tensors are on {device} (expected inputs on {device}, as each member's own "
        f"module requires: the loop raises). Move it with .to('{device}')."
    )


def refuse_inference_tensors(
    where: str, params: dict[str, Tensor], *, recorded: Collection[str] | None = None
) -> None:
    """Refuse a call that records autograd history on parameters made under
    ``torch.inference_mode()`` (an ensemble built there).

    Autograd cannot record them: the loop's modules raise at their first such forward
    ("cannot be saved for backward"), or give no gradient at all (one ``Linear`` on an
    input without history), and the stacked views of the vectorized call would give
    some of the parameters a gradient and not others. ``recorded``: the names autograd
    records (by default those requiring grad).
    """
    if (
        torch.compiler.is_compiling()  # (Dynamo traces neither query; eager refuses)
        or not torch.is_grad_enabled()
        or torch.is_inference_mode_enabled()
    ):
        return
    for name, t in params.items():
        # Those autograd records: by default the ones requiring grad (a frozen one
        # records nothing: the loop runs it, or raises where backward would need it
        # saved, as torch does here too).
        records = t.requires_grad if recorded is None else name in recorded
        if isinstance(t, Tensor) and records and t.is_inference():
            raise RuntimeError(
                f"{where}: parameter `{name}` is an inference tensor (made under "
                "torch.inference_mode(), as is every tensor of an ensemble built "
                "there), which autograd cannot record (expected parameters made outside "
                "inference_mode, got inference tensors in a call with grad enabled). "
                "Run the call under torch.inference_mode() or torch.no_grad(), or build "
                "the ensemble outside inference_mode to train it."
            )


def run(
    steps: Plan,
    params: dict[str, Tensor],
    x: Tensor,
    member_dim: int | None,
    where: str = "vmap",
) -> Tensor | None:
    """Run the chain on stacked ``params``; ``x`` is shared or has ``member_dim``.

    Returns ``[N, *lead, out]``, or ``None`` if this call needs the general path.
    """
    if _torch_compat.global_module_hooks() or x.dim() < 1 or x.shape[-1] == 0:
        return None  # (no input features: rows cannot be told apart in a reshape)
    if not torch.compiler.is_compiling() and _torch_compat.foreign_mode_active():
        return None  # a user's mode sees the members' own ops on the general path
    # Autocast casts the operands of the plain ops (addmm, baddbmm, bmm) as it casts
    # the loop's F.linear, but not those of an op writing into out= or of the compiled
    # MLP op: under it only the plain-op chain runs.
    autocast = _torch_compat.autocast_enabled(x.device.type)
    for module, weight, _ in steps:
        if weight is None and type(module) is nn.Dropout and module.training and module.p > 0:
            return None  # random masks follow vmap's randomness rules: general path
    first = next(params[w] for _, w, _ in steps if w is not None)
    if x.is_meta and not first.is_meta:
        raise RuntimeError(meta_input_error(where, "the input", first.device))
    if first.is_complex():
        return None  # our backward passes transpose without conjugating: general path
    n = first.shape[0]
    if not n:
        return None  # no members (sliced or assigned empty): the general path decides
    refuse_inference_tensors(where, params)
    if member_dim is not None:
        x = x.movedim(member_dim, 0)
        if x.dim() < 2 or x.shape[0] != n:
            return None
    check_widths(where, steps, params, n, x.shape[-1])
    if not autocast:
        check_dtype(where, steps, params, x)
    if torch.compiler.is_compiling() and not autocast:
        out = _compiled_chain(steps, params, x, n, shared=member_dim is None)
        if out is not None:
            lead = x.shape[:-1] if member_dim is None else x.shape[1:-1]
            return out.view(n, *lead, out.shape[-1])
    # Activations run feature-major, [N, features, rows]: each layer is then
    # W @ h + b on the weights exactly as stored ([N, out, in]), so no operand is
    # transposed and the weight gradients g @ h^T come out in the weights' own layout
    # (row-major activations would hand autograd transposed gradients to copy).
    if member_dim is None:
        lead = x.shape[:-1]
        h = x.reshape(-1, x.shape[-1]).t()  # shared by all members: [in, rows]
        if (torch.is_grad_enabled() or torch.jit.is_tracing()) and not autocast:
            # (torch.jit.trace checks its trace by tracing again without grad: one
            # graph either way.) Row-major [in, rows] (a copy of x, small next to the
            # layer): autograd then computes the first layer's dW = g @ h^T and dx = W^T @ g in the
            # orientation BLAS runs fast. On the transposed view of x both are thin
            # GEMMs several times slower (measured at [1280 x 4] weights and 256 rows,
            # one thread: 388 us vs 88 us for dW, 426 us vs 63 us for dx); the
            # forward is the same either way, so inference keeps the view.
            h = h.contiguous()
    else:
        lead = x.shape[1:-1]
        h = x.reshape(n, -1, x.shape[-1]).transpose(1, 2)
    if not autocast and _kept_buffers(steps, params, h, n):
        h = _chain_kept(steps, params, h, n, shared=member_dim is None)
    else:
        h = _chain(steps, params, h, n, shared=member_dim is None)
    h = _members_first(h, n)
    out = h.transpose(1, 2)
    if out.is_contiguous() and _ends_saved(steps) and (h.requires_grad or torch.jit.is_tracing()):
        # One output feature (or row): the transpose is the last activation's own
        # output, which its backward reads. The loop's torch.stack hands back a fresh
        # tensor, which the caller may change in place before backward(): a copy too.
        # (Traced, always: the graph must not depend on grad mode.)
        out = out.clone()
    return out.contiguous().view(n, *lead, h.shape[1])


def _ends_saved(steps: Plan) -> bool:
    """Whether the chain ends with an activation applied in place, whose output its
    backward reads (skipped identities and eval dropout after it aside)."""
    for module, weight, _ in reversed(steps):
        kind = type(module)
        if weight is None and kind in (nn.Identity, nn.Dropout):
            continue
        return weight is None and kind in _IN_PLACE
    return False


def _members_first(h: Tensor, n: int) -> Tensor:
    """``[N * features, rows]`` as ``[N, features, rows]`` (sizes spelled out: with no
    rows, a ``-1`` would be ambiguous); a 3-d ``h`` is returned as it is."""
    return h.view(n, h.shape[0] // n, h.shape[-1]) if h.dim() == 2 else h


def _chain(steps: Plan, params: dict[str, Tensor], h: Tensor, n: int, *, shared: bool) -> Tensor:
    """The layers on feature-major ``h``; returns ``[N, out, rows]`` or ``[N * out, rows]``.

    ``h`` is ``[N, in, rows]``, or ``[in, rows]`` when every member sees the same
    input (``shared``): the first Linear then runs as ONE matrix product of all
    members' weights, ``[N * out, in] @ [in, rows]``, whose ``[N * out, rows]`` result
    is already member-major (one large GEMM instead of N small ones, in the forward
    and for the weight gradient).
    """
    fresh = False  # whether h is a layer output of ours that nothing else holds
    for module, weight, bias in steps:
        kind = type(module)
        if weight is None:
            if kind is nn.Dropout:
                continue
            if fresh and kind in _IN_PLACE:
                # In place on h itself, never on a view of it: autograd would record
                # a copy of the whole base for an in-place op on a view.
                h = _activate_fresh(kind, h)
            else:
                h = _ELEMENTWISE[kind](module, h)
            fresh = False
            continue
        w = params[weight]
        if shared:
            w2 = w.reshape(-1, w.shape[-1])
            b = None if bias is None else params[bias].reshape(-1, 1)
            h = torch.mm(w2, h) if b is None else torch.addmm(b, w2, h)
            shared = False
        else:
            h = _members_first(h, n)
            if bias is None:
                h = torch.bmm(w, h)
            else:
                h = torch.baddbmm(params[bias].unsqueeze(2), w, h)
        fresh = True
    if shared:  # no Linear ran (plan() refuses such chains; kept for safety)
        h = h.expand(n, -1, -1)
    return h


def _kept_buffers(steps: Plan, params: dict[str, Tensor], h: Tensor, n: int) -> bool:
    """Whether this call runs its layers as ``_linear_act.LinearAct``: CPU eager only
    (elsewhere the caching allocator already reuses memory, and a traced or transformed
    call needs the plain ops), and only where a layer's output is large enough for a
    kept buffer (below that the plain ops cost less Python)."""
    widest = max(params[w].shape[1] for _, w, _ in steps if w is not None)
    return (
        h.device.type == "cpu"
        and n * widest * h.shape[-1] * h.element_size() >= _workspace.MIN_BYTES
        and not torch.compiler.is_compiling()
        and not _torch_compat.inside_transform()
        and not _torch_compat.forward_ad_active()
        # A tracer (make_fx, torch.jit.trace) would record the out= kernels, which
        # autograd refuses to differentiate, or not see the buffers' reuse.
        and not _torch_compat.ops_observed()
    )


def _chain_kept(
    steps: Plan, params: dict[str, Tensor], h: Tensor, n: int, *, shared: bool
) -> Tensor:
    """``_chain`` with each Linear and the activation after it as one ``LinearAct``,
    which writes into buffers kept across steps; other activations run as ops."""
    k = 0
    while k < len(steps):
        module, weight, bias = steps[k]
        k += 1
        kind = type(module)
        if weight is None:
            if kind is not nn.Dropout:  # eval or p=0 (run() sent training dropout away)
                h = _ELEMENTWISE[kind](module, h)
            continue
        while k < len(steps) and type(steps[k][0]) is nn.Dropout:
            k += 1
        act = None
        if k < len(steps) and steps[k][1] is None:
            act = _linear_act.ACTIVATIONS.get(type(steps[k][0]))
            k += act is not None
        w = params[weight]
        b = None if bias is None else params[bias]
        h = h if shared else _members_first(h, n)
        if _linear_act.recorded(h, w, b):
            h = _linear_act.LinearAct.apply(h, w, b, act)
        else:
            h = _linear_act.layer(h, w, b, act)
        shared = False
    if shared:  # no Linear ran (plan() refuses such chains; kept for safety)
        h = h.expand(n, -1, -1)
    return h


def _compiled_chain(
    steps: Plan, params: dict[str, Tensor], x: Tensor, n: int, *, shared: bool
) -> Tensor | None:
    """The chain as one opaque op for ``torch.compile`` (see ``_mlp_op``), or ``None``."""
    found = _mlp_op.layers(steps)
    if found is None:
        return None
    weights, biases, acts = found
    x = x.reshape(-1, x.shape[-1]) if shared else x.reshape(n, -1, x.shape[-1])
    outputs = _mlp_op.mlp_forward(
        x,
        [params[w] for w in weights],
        [params[b] for b in biases if b is not None],
        [b is not None for b in biases],
        acts,
    )
    return outputs[0]


def _direct_plan(skeleton: nn.Module, x: Any, in_dims: Any) -> tuple[Plan, int | None] | None:
    """The chain and member dim for a direct (not inside a transform) call on ``x``."""
    dim = in_dims[0] if isinstance(in_dims, tuple) and len(in_dims) == 1 else in_dims
    if (
        not isinstance(x, Tensor)
        or isinstance(dim, bool)
        or not (dim is None or isinstance(dim, int))
    ):
        return None
    if dim is not None and not -x.dim() <= dim < x.dim():
        return None  # the general path explains
    if not torch.compiler.is_compiling() and _torch_compat.inside_transform():
        return None  # inside another torch.func transform: let vmap compose with it
    steps = plan(skeleton)
    return None if steps is None else (steps, dim)


def fast_call(
    skeleton: nn.Module,
    params: dict[str, Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dims: tuple[Any, ...] | None,
    *,
    where: str = "vmap",
) -> Tensor | None:
    """The one entry to the fast path: the stacked output of an MLP call, or ``None``.

    The three ways a stacked MLP is called all come here:

    - ``fe.vmap(fmodel)(params, buffers, x)``: ``params`` the stacked dict, ``dims``
      the call's checked ``in_dims`` (see ``_in_dims``);
    - ``Ensemble.forward(x)``: ``params=None``, the stacked tensors are read straight
      off ``skeleton``'s layers (no name-to-tensor dicts: for a small MLP this per-call
      overhead is what separates one vectorized member from one plain module);
    - ``fmodel(params, buffers, x)`` for ONE member inside ``fe.vmap`` (e.g. in a loss
      given to ``fe.value_and_grad``): ``dims=None``, ``params`` are BatchedTensors
      (see [`_batched_call`][]).

    ``None`` means: take the general ``vmap`` path (it also explains errors).
    """
    if kwargs or len(args) != 1:
        return None
    if dims is None:
        return _batched_call(skeleton, params or {}, args[0], where)
    found = _direct_plan(skeleton, args[0], dims)
    if found is None:
        return None
    steps, dim = found
    if params is None:
        params = {}
        for module, weight, bias in steps:
            if weight is not None:
                params[weight] = module.weight
                if bias is not None:
                    params[bias] = module.bias
    elif any(
        name is not None and not isinstance(params.get(name), Tensor)
        for _, weight, bias in steps
        for name in (weight, bias)
    ):
        return None  # e.g. one Linear instance used twice: its second name is not a key
    return run(steps, params, args[0], dim, where)


def _batched_call(skeleton: nn.Module, params: dict[str, Any], x: Any, where: str) -> Tensor | None:
    """The fast path for ``fmodel(params, buffers, x)`` called inside ``fe.vmap``.

    Inside ``vmap`` (e.g. in a loss given to ``fe.value_and_grad``) ``params`` are
    BatchedTensors. When they are batched along dim 0 at the innermost level and no
    other transform is involved, run the stacked kernels on the unwrapped tensors and
    hand the result back to vmap as a BatchedTensor: this is a batching rule for the
    whole MLP. Autograd sees ordinary ops on the unwrapped leaves.
    """
    if not isinstance(x, Tensor) or x.dim() < 1:
        return None
    if torch.compiler.is_compiling():
        if _torch_compat.autocast_enabled(x.device.type):
            return None  # the compiled MLP op's operands would not be cast (see run())
        return _compiled_member_call(skeleton, params, x, where)
    level = _torch_compat.vmap_level()
    if level is None:
        return None
    steps = plan(skeleton)
    if steps is None:
        return None
    unwrapped = {}
    for _, weight, bias in steps:
        for name in (weight, bias):
            if name is None or name in unwrapped:
                continue
            value = params.get(name)
            found = _torch_compat.unwrap_at(value, level) if isinstance(value, Tensor) else None
            if found is None or found[1] != 0:
                return None
            unwrapped[name] = found[0]
    found_x = _torch_compat.unwrap_at(x, level)
    if found_x is None:
        return None
    # Step out of this vmap level while running on its unwrapped tensors: our kernels
    # (and their autograd.Function) then see no transform at all.
    with _torch_compat.lower_vmap():
        out = run(steps, unwrapped, *found_x, where)
    if out is None:
        return None
    return _torch_compat.add_batch_dim(out, 0, level)


def _compiled_member_call(
    skeleton: nn.Module, params: dict[str, Any], x: Tensor, where: str
) -> Tensor | None:
    """``_batched_call`` under ``torch.compile``: ONE member's chain as
    [`_mlp_member_op.member_mlp`][], whose ``torch.func`` rules run the stacked ops."""
    if _torch_compat.global_module_hooks():
        return None
    steps = plan(skeleton)
    found = None if steps is None else _mlp_op.layers(steps)
    if steps is None or found is None:
        return None
    for module, weight, _ in steps:
        if weight is None and type(module) is nn.Dropout and module.training and module.p > 0:
            return None
    weights, biases, acts = found
    present = [b for b in biases if b is not None]
    if any(not isinstance(params.get(name), Tensor) for name in (*weights, *present)):
        return None
    if params[weights[0]].is_complex() or x.dim() < 1 or x.shape[-1] == 0:
        return None  # as in run()
    width = x.shape[-1]
    for i, name in enumerate(weights):
        shape = tuple(params[name].shape)
        if shape[-1] != width:
            raise ValueError(width_error(where, name, shape, width, first=i == 0))
        width = shape[0]
    out = _mlp_member_op.member_mlp(
        x.reshape(-1, x.shape[-1]),
        [params[name] for name in weights],
        [params[name] for name in present],
        [b is not None for b in biases],
        acts,
    )
    return out.view(*x.shape[:-1], out.shape[-1])
