"""``predict``: one batch through every rank's members, reduced over all N members.

Inference of a sharded ensemble in one call: the batch is broadcast from one rank (or
already the same on every rank), split along the mesh's ``"data"`` axis when there is
one, run through this rank's members, and reduced over the members of every rank by the
``fe.distributed`` reductions, which all-reduce per-rank sums, maxima or minima instead
of gathering the members' outputs. With data replicas, the named reductions' results
on the replicas' parts of the batch (batch first) are then gathered along ``"data"``,
so that every rank returns the results for the whole batch; a custom reduction, whose
result's batch axis cannot be known (it may keep the member axis, or be a pytree),
runs on the members' outputs for the whole batch, gathered along ``"data"`` first.
The reductions' names and ``src`` ride in every collective's layout check (the
enclosing call's digest), so ranks that pass other ones all raise at the first.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from .. import _tree
from .._core.ensemble import Ensemble
from .._messages import submodule
from ._collectives import (
    _check_layout,
    _check_shard,
    _collective,
    _Tree,
    broadcast,
    calling,
)
from ._collectives import max as max_
from ._collectives import mean as mean_
from ._collectives import min as min_
from ._collectives import std as std_
from ._collectives import var as var_
from ._gather import gather_stacked
from ._member_shard import MemberShard
from ._refusal import agree_to_start, ranks
from ._uncertainty import (
    expected_entropy,
    mean_log_probs,
    mean_probs,
    mutual_information,
    predictive_entropy,
)

Reduction = Callable[[Tensor, MemberShard], Tensor]

REDUCTIONS: dict[str, Reduction] = {
    "mean": mean_,
    "var": var_,
    "std": std_,
    "min": min_,
    "max": max_,
    "mean_probs": mean_probs,
    "mean_log_probs": mean_log_probs,
    "predictive_entropy": predictive_entropy,
    "expected_entropy": expected_entropy,
    "mutual_information": mutual_information,
}


def _reductions(where: str, reductions: object) -> dict[str, Reduction]:
    if isinstance(reductions, str):
        reductions = (reductions,)
    if isinstance(reductions, Mapping):
        chosen = dict(reductions)
        for name, fn in chosen.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(
                    f"{where}: reductions as a mapping must map names (str) to functions "
                    f"(expected fn(local, shard) under a str name, got {name!r}: "
                    f"{type(fn).__name__}). Map each name to its function."
                )
    elif isinstance(reductions, Sequence):
        chosen = {}
        for name in reductions:
            if name not in REDUCTIONS:
                raise ValueError(
                    f"{where}: unknown reduction {name!r} (expected one of "
                    f"{sorted(REDUCTIONS)}, got {name!r}). Pick one of those, or pass a "
                    "mapping of names to functions fn(local, shard) (e.g. for subset_min)."
                )
            chosen[name] = REDUCTIONS[name]
    else:
        raise TypeError(
            f"{where}: reductions must be a sequence of names or a mapping of names to "
            f"functions (expected e.g. ('mean', 'var'), got {type(reductions).__name__}). "
            "Name the reductions in a tuple or list."
        )
    if not chosen:
        raise ValueError(
            f"{where}: reductions is empty (expected at least one reduction, got none). "
            "Name at least one, e.g. ('mean',)."
        )
    return chosen


def _describe(chosen: dict[str, Reduction], src: int | None) -> dict[str, str]:
    """What every rank must pass ``predict`` alike: the reductions, in order, and ``src``."""
    parts = [
        repr(name)
        if REDUCTIONS.get(name) is fn
        else f"{name!r}: {getattr(fn, '__qualname__', type(fn).__qualname__)}"
        for name, fn in chosen.items()
    ]
    return {"the call": "predict", "reductions": ", ".join(parts), "src": repr(src)}


def _batch_size(where: str, leaves: list[Any]) -> int:
    sizes = {tuple(x.shape[:1]) for x in leaves if isinstance(x, Tensor)}
    if len(sizes) != 1 or () in sizes:
        raise ValueError(
            f"{where}: with data replicas every tensor input is split along its dim 0, the "
            f"batch, but the inputs differ there (expected tensors with one batch size, "
            f"got leading sizes {sorted(s[0] if s else 'none' for s in sizes)}). Give "
            "every tensor input the batch as its first axis."
        )
    return next(iter(sizes))[0]


def _gather_batch(where: str, name: str, part: Tensor, shard: MemberShard, rows: int) -> Tensor:
    """The data replicas' results on their parts of the batch, joined in batch order."""
    if part.dim() == 0 or part.shape[0] != rows:
        got = part.shape[0] if part.dim() else "no batch axis"
        raise ValueError(
            f"{where}: reduction {name!r} gave leading size {got} on this data replica's "
            f"{rows} samples; with a data axis, reduced results must keep the batch axis "
            "first so that the replicas' parts can be joined."
        )
    part = part.contiguous()
    _check_layout(
        where,
        shard.data_rank,
        shard.data_size,
        shard.data_group,
        part,
        tuple(part.shape),
        f"reduction {name!r} results",
    )
    return _collective(
        where,
        shard.data_rank,
        shard.data_size,
        lambda: gather_stacked(part, shard.data_size, shard.data_group).flatten(0, 1),
        shard.data_group,
    )


def _gather_outputs(where: str, outputs: Any, shard: MemberShard, rows: int) -> Any:
    """The members' outputs ``[n_r, rows, ...]`` of every data replica, joined along the
    batch (dim 1) into this rank's members' outputs on the whole batch."""
    paths, leaves, spec = _tree.flatten_with_paths(outputs)
    described = _Tree(
        outputs,
        "Every data replica's model must return the same structure, with tensors of the "
        "same dtypes and shapes.",
        member_first=True,
    )
    if not any(isinstance(x, Tensor) for x in leaves):
        described.check_empty(where, shard.data_rank, shard.data_size, shard.data_group)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, Tensor):
            out.append(leaf)
            continue
        if leaf.dim() < 2:
            # No batch axis after the members ([n_r], a value per member): kept as it
            # is where every replica holds the same; one made from this replica's part
            # of the batch would not be the whole batch's, and is refused.
            out.append(_same_on_replicas(where, path, leaf, shard, described))
            continue
        if leaf.shape[1] != rows:
            label = "the model's output" + (f" leaf `{path}`" if path else "")
            raise ValueError(
                f"{where}: {label} has shape {tuple(leaf.shape)} on this data replica's "
                f"{rows} samples (expected this rank's members, then the batch: "
                f"({shard.size}, {rows}, ...)); with data replicas, a custom reduction runs "
                "on the whole batch, the replicas' outputs joined along dim 1. Return the "
                "batch after the member axis, or predict on a shard without a data axis."
            )
        part = leaf.transpose(0, 1)  # the batch first: the replicas' parts join along it
        part = (part.to(torch.uint8) if leaf.dtype == torch.bool else part).contiguous()
        _check_layout(
            where,
            shard.data_rank,
            shard.data_size,
            shard.data_group,
            part,
            tuple(part.shape),
            "model outputs (batch first)",
            described,
        )
        whole = _collective(
            where,
            shard.data_rank,
            shard.data_size,
            lambda p=part: gather_stacked(p, shard.data_size, shard.data_group).flatten(0, 1),
            shard.data_group,
        )
        whole = whole.transpose(0, 1).contiguous()
        out.append(whole.bool() if leaf.dtype == torch.bool else whole)
    return _tree.unflatten(spec, out)


def _same_on_replicas(
    where: str, path: str, leaf: Tensor, shard: MemberShard, described: "_Tree"
) -> Tensor:
    """``leaf``, checked to be the same on every data replica (raised on every one)."""
    part = (leaf.to(torch.uint8) if leaf.dtype == torch.bool else leaf).contiguous()
    _check_layout(
        where,
        shard.data_rank,
        shard.data_size,
        shard.data_group,
        part,
        tuple(part.shape),
        "model outputs without a batch axis",
        described,
    )
    rows = _collective(
        where,
        shard.data_rank,
        shard.data_size,
        lambda: gather_stacked(part, shard.data_size, shard.data_group),
        shard.data_group,
    ).view(shard.data_size, -1)
    if not all(torch.equal(rows[0], x) for x in rows[1:]):
        label = "the model's output" + (f" leaf `{path}`" if path else "")
        raise ValueError(
            f"{where}: {label} has shape {tuple(leaf.shape)}, no batch axis after the "
            "members, and differs between the data replicas (expected the same on every "
            "replica, or the batch after the member axis): computed from each replica's "
            "part of the batch, it is not what one process computes from the whole "
            "batch. Return it per sample ([members, batch, ...]), or predict on a shard "
            "without a data axis."
        )
    return leaf


def _check_outputs(where: str, outputs: object, shard: MemberShard) -> None:
    """Name the model, not a reduction's argument, when its output misses the member axis."""
    if isinstance(outputs, Tensor) and (outputs.dim() == 0 or outputs.shape[0] != shard.size):
        got = outputs.shape[0] if outputs.dim() else "no member axis"
        raise ValueError(
            f"{where}: the model's output has leading size {got}, but rank {shard.rank} "
            f"holds {shard.size} members ({shard.members.start}:{shard.members.stop} of "
            f"{shard.num_members}). Pass this rank's members as model (e.g. "
            "shard.from_factory(...)), returning their outputs with the member axis first."
        )


def _check_no_batch_statistics(where: str, model: object, shard: MemberShard) -> None:
    """Refuse train-mode layers whose output or buffers depend on the whole batch.

    Each data replica runs its part of the batch: a BatchNorm in train mode would
    normalize each part by its own statistics (not the whole batch's) and update each
    replica's running statistics from its own part, so the replicas drift apart.
    """
    if not isinstance(model, nn.Module):
        return
    always = [  # no running statistics: the batch's, in eval mode too
        name
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.running_mean is None and m.running_var is None
    ]
    if always:
        layers = ", ".join(
            f"{submodule(name)} ({type(model.get_submodule(name)).__name__})" for name in always
        )
        raise ValueError(
            f"{where}: {layers} normalize{'s' if len(always) == 1 else ''} by the batch's "
            "statistics in eval mode too (track_running_stats=False), but with "
            f"{shard.data_size} data replicas each runs its own part of the batch (expected "
            "layers whose output does not depend on the rest of the batch): each replica "
            "would normalize by its part's statistics, not the whole batch's. Predict on a "
            "shard without a data axis."
        )
    found = [
        name
        for name, m in model.named_modules()
        if m.training
        and isinstance(m, _NormBase)
        and (isinstance(m, _BatchNorm) or m.track_running_stats)
    ]
    if found:
        layers = ", ".join(
            f"{submodule(name)} ({type(model.get_submodule(name)).__name__})" for name in found
        )
        raise ValueError(
            f"{where}: {layers} {'is' if len(found) == 1 else 'are'} in train mode, but "
            f"with {shard.data_size} data replicas each runs its own part of the batch "
            "(expected batch-statistics layers in eval mode, got train mode): each replica "
            "would normalize by its part's statistics, not the whole batch's, and update "
            "its own running statistics. Call model.eval() before predict (and "
            "model.train() after), or predict on a shard without a data axis."
        )


def predict(
    model: Callable[..., Any],
    shard: MemberShard,
    *inputs: Any,
    reductions: Sequence[str] | Mapping[str, Reduction] = ("mean",),
    src: int | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run a batch through every rank's members and reduce over all N members.

    A collective: every rank calls it with its own members, and the same
    ``reductions`` (the same names, in the same order) and ``src``: these ride in the
    first collective's check, and ranks that pass other ones all raise a
    ``ValueError`` naming each rank's, before any value is combined. The batch is

    1. broadcast from rank ``src`` of the ranks holding this ensemble when ``src``
       is given (the other ranks pass tensors of the same shapes and dtypes, e.g.
       ``torch.empty``); with ``src=None`` every rank must pass the same batch (e.g.
       read from one file or drawn from one seed), which costs no communication. The
       broadcast runs over the shard's own ranks: its ``group`` (``src`` counted as
       ``shard.rank`` counts, so ``src=0`` is the group's first rank, whatever its
       global rank), or with data replicas the whole mesh (``src`` a global rank,
       ``torch.distributed.get_rank()``). Ensembles on other groups are not involved;
    2. split along dim 0 of every tensor input when the shard's mesh has a ``"data"``
       axis: replica d runs its part
       ([`batch_slice`][funcensemble.distributed.MemberShard.batch_slice]);
    3. run through this rank's members, ``model(*inputs, **kwargs)`` under
       ``torch.no_grad()``, giving ``[n_r, ...]`` outputs (members first);
    4. reduced over all N members by each reduction, which all-reduces per-rank sums,
       maxima or minima (the members' outputs never leave their rank);
    5. with data replicas, the reduced parts are gathered along ``"data"`` so that
       every rank returns the results for the whole batch. A reduction given as a
       function may return anything (the members kept, as ``all_gather`` does, or a
       pytree), so ``predict`` cannot know its result's batch axis: it runs on this
       rank's members' outputs for the whole batch instead, ``[n_r, B, ...]``, gathered
       along ``"data"`` first (each output's dim 1 must be the batch; a leaf with no
       dimension after the members is kept where every replica holds the same). Its result is
       then exactly the function's on the whole batch; the gather moves ``n_r`` times
       more than a reduced part.

    Named reductions: ``"mean"``, ``"var"``, ``"std"``, ``"min"``, ``"max"`` (any
    outputs), ``"mean_probs"``, ``"mean_log_probs"``, ``"predictive_entropy"``,
    ``"expected_entropy"`` and ``"mutual_information"`` (logits, classes last). Others
    (e.g. [`subset_min`][funcensemble.distributed.subset_min] with its ``k`` and
    generator) are given as functions ``fn(local_outputs, shard)``.

    Exactness against the single-process ``fe.reduce`` function on all N members'
    outputs: ``min``, ``max`` and ``subset_min`` are equal bit for bit (they select,
    they do not add); the others add in another order across ranks, so they agree up
    to rounding (see "Inference at scale" in the scale-out guide for measured
    figures). On one rank of the member axis every result is ``fe.reduce``'s, bit for
    bit. With data replicas, the members run on parts of the batch (their kernels may
    round otherwise than on the whole batch); a function given as a reduction sees the
    whole batch (5. above), so one that draws per sample
    (``subset_min(..., per_sample=True)``) makes the draw one process makes. The
    members run on each replica's own part, so a ``model`` with a BatchNorm in train
    mode (or another norm layer updating running statistics) is refused with data
    replicas, before anything runs: each replica would normalize by its own part's
    statistics. Call
    ``model.eval()`` first. A model that is not an ``nn.Module`` (a function calling
    one) cannot be looked into: put its modules in eval mode yourself.

    Args:
        model: This rank's members, e.g. the ``Ensemble`` from
            [`MemberShard.from_factory`][funcensemble.distributed.MemberShard.from_factory],
            or any function returning a tensor with ``shard.size`` members first.
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].
        *inputs: The batch (tensors or pytrees of them), dim 0 the sample axis.
        reductions: Names of reductions, or a mapping of result names to functions
            ``fn(local_outputs, shard)`` such as ``fe.distributed.var``.
        src: The rank that holds the batch, counted in the shard's group (see 1.
            above), or ``None`` if every rank has it.
        **kwargs: Keyword arguments of ``model``, shared (not broadcast or split).

    Returns:
        ``{name: result}``, the same on every rank; each result is what the reduction
        returns for all N members on the whole batch (a pytree where the function
        returns one).

    Raises:
        ValueError: An unknown reduction name, no reductions, a ``src`` that is not
            a rank of the shard's group (checked before any communication), a model
            with a train-mode BatchNorm on a shard with data replicas, inputs
            of different batch sizes (or one not divisible by the data axis's size),
            a model output whose leading size is not this rank's member count (or,
            for a reduction given as a function with data replicas, whose dim 1 is
            not this replica's part of the batch), or ranks that passed other
            ``reductions`` or ``src`` (raised on every rank, naming each rank's).
        TypeError: ``shard`` is not a ``MemberShard``, or ``reductions`` is malformed.
        DistributedError: A collective failed (another rank crashed or timed out).

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(5)  # one process; the same under torchrun
        >>> ens = shard.from_factory(lambda: torch.nn.Linear(3, 4))
        >>> x = torch.randn(8, 3)
        >>> out = fe.distributed.predict(ens, shard, x, reductions=["mean", "mutual_information"])
        >>> out["mean"].shape, out["mutual_information"].shape
        (torch.Size([8, 4]), torch.Size([8]))
        >>> with torch.no_grad():  # predict's own mode (autograd on may round differently)
        ...     alone = fe.reduce.mutual_information(ens(x))
        >>> torch.equal(out["mutual_information"], alone)
        True
    """
    where = "predict"
    shard = _check_shard(where, shard)
    chosen, refused = {}, None
    try:
        chosen = _check_arguments(where, model, shard, inputs, reductions, src)
    except (TypeError, ValueError) as error:
        # The other ranks would wait in the first collective for this one: the flag in
        # the exchange below makes every rank raise this error.
        refused = error
    call = {} if refused else _describe(chosen, src)
    agree_to_start(where, call, refused, *ranks(shard))
    with torch.no_grad(), calling(where, call):
        return _run(where, model, shard, inputs, kwargs, chosen, src)


def _check_arguments(
    where: str,
    model: object,
    shard: MemberShard,
    inputs: tuple[Any, ...],
    reductions: object,
    src: object,
) -> dict[str, Reduction]:
    """``predict``'s checks of this rank's own arguments, made before any exchange."""
    if not callable(model):
        raise TypeError(
            f"{where}: model must be callable (expected a function of the inputs, got "
            f"{type(model).__name__}). Pass this rank's ensemble or a function calling it."
        )
    chosen = _reductions(where, reductions)
    if isinstance(model, Ensemble):
        shard._check_randomness(where, model.randomness)
    if shard.data_size > 1:
        _check_no_batch_statistics(where, model, shard)
        if src is None:  # this rank's own batch: with src, every rank splits src's
            _check_split(where, _batch_size(where, _tree.leaves(inputs)), shard)
    if src is not None:
        _, world, _ = shard._all_ranks()
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
            raise ValueError(
                f"{where}: src must be a rank in 0..{world - 1} (expected an int rank of "
                f"the group, got {src!r}): one of the {world} ranks holding this ensemble, "
                "counted as shard.rank counts them. Pass the rank in the shard's group, "
                "not in the default group: with MemberShard(N, group=...) the group's "
                "first rank is 0, whatever its global rank."
            )
    return chosen


def _check_split(where: str, size: int, shard: MemberShard) -> None:
    if size % shard.data_size:
        raise ValueError(
            f"{where}: a batch of {size} samples cannot be split into "
            f"{shard.data_size} equal parts, one per data replica (expected a multiple "
            f"of {shard.data_size}): the replicas' results are gathered in equal "
            f"parts. Pad the batch to a multiple of {shard.data_size} and drop the "
            "padded rows' results, or predict on a shard without a data axis."
        )


def _run(
    where: str,
    model: Callable[..., Any],
    shard: MemberShard,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    chosen: dict[str, Reduction],
    src: int | None,
) -> dict[str, Any]:
    """``predict`` after its checks: broadcast, split, run, reduce, gather."""
    if src is not None:
        inputs = broadcast(inputs, src=src, group=shard._all_ranks()[2])
    rows = None
    if shard.data_size > 1:
        leaves, spec = _tree.flatten(inputs)
        size = _batch_size(where, leaves)
        _check_split(where, size, shard)  # src's batch: the same on every rank
        mine = shard.batch_slice(size)
        rows = mine.stop - mine.start
        inputs = _tree.unflatten(spec, [x[mine] if isinstance(x, Tensor) else x for x in leaves])
    try:
        outputs = model(*inputs, **kwargs)
        _check_outputs(where, outputs, shard)
        refused = None
    except Exception as error:  # the model's own, or the check of its outputs
        # The other ranks would wait for this one in the reductions' exchanges.
        refused = error
    agree_to_start(where, {}, refused, *ranks(shard))
    if rows is None:
        return {name: fn(outputs, shard) for name, fn in chosen.items()}
    results, whole = {}, None
    for name, fn in chosen.items():
        if fn in REDUCTIONS.values():  # batch first: reduce this part, join the parts
            results[name] = _gather_batch(where, name, fn(outputs, shard), shard, rows)
            continue
        if whole is None:
            whole = _gather_outputs(where, outputs, shard, rows)
        results[name] = fn(whole, shard)
    return results
