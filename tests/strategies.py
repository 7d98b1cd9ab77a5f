"""Hypothesis strategies for the property tests: generated ensembles, inputs, optimizers.

A case is plain data (``Case``): hypothesis draws the *structure* (depth, widths, layer
kinds, options, member count, dtype, input layout, chunk size, optimizer flags) and one
integer seed from which every *number* (weights, inputs, per-member hyperparameters)
is drawn with a seeded ``torch.Generator``. Members are then built from the case as
ordinary modules, so the reference is always the plain loop over them.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

# --- activations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Act:
    """One elementwise activation: its class name and constructor arguments."""

    name: str
    kwargs: tuple[tuple[str, object], ...] = ()

    def build(self, width: int) -> nn.Module:
        kwargs = dict(self.kwargs)
        if self.name == "PReLU" and kwargs.pop("per_channel", False):
            kwargs["num_parameters"] = width
        return getattr(nn, self.name)(**kwargs)


def _act(name: str, **kwargs: st.SearchStrategy) -> st.SearchStrategy[Act]:
    keys = sorted(kwargs)
    return st.tuples(*(kwargs[k] for k in keys)).map(
        lambda values: Act(name, tuple(zip(keys, values, strict=True)))
    )


_small = st.sampled_from([0.01, 0.1, 0.5, 1.0, 2.0])

# Every elementwise activation in torch.nn (tests/test_properties.py checks the list
# against torch.nn.modules.activation), with its options drawn.
ACTIVATIONS: dict[str, st.SearchStrategy[Act]] = {
    "Identity": st.just(Act("Identity")),
    "ReLU": st.just(Act("ReLU")),
    "ReLU6": st.just(Act("ReLU6")),
    "Sigmoid": st.just(Act("Sigmoid")),
    "Tanh": st.just(Act("Tanh")),
    "SiLU": st.just(Act("SiLU")),
    "Mish": st.just(Act("Mish")),
    "Hardswish": st.just(Act("Hardswish")),
    "Hardsigmoid": st.just(Act("Hardsigmoid")),
    "SELU": st.just(Act("SELU")),
    "LogSigmoid": st.just(Act("LogSigmoid")),
    "Softsign": st.just(Act("Softsign")),
    "Tanhshrink": st.just(Act("Tanhshrink")),
    "GELU": _act("GELU", approximate=st.sampled_from(["none", "tanh"])),
    "LeakyReLU": _act("LeakyReLU", negative_slope=_small),
    "ELU": _act("ELU", alpha=_small),
    "CELU": _act("CELU", alpha=_small),
    "Softplus": _act("Softplus", beta=_small, threshold=st.sampled_from([1.0, 20.0])),
    "Hardtanh": _act(
        "Hardtanh", min_val=st.sampled_from([-2.0, -1.0]), max_val=st.sampled_from([0.5, 1.0])
    ),
    "Threshold": _act(
        "Threshold", threshold=st.sampled_from([-0.5, 0.0, 0.3]), value=st.sampled_from([0.0, -1.0])
    ),
    "Hardshrink": _act("Hardshrink", lambd=st.sampled_from([0.1, 0.5])),
    "Softshrink": _act("Softshrink", lambd=st.sampled_from([0.1, 0.5])),
    # RReLU draws its slopes in train mode; it always runs in eval mode here (see Block).
    "RReLU": _act(
        "RReLU", lower=st.sampled_from([0.1, 0.125]), upper=st.sampled_from([0.3, 1 / 3])
    ),
    "PReLU": _act("PReLU", per_channel=st.booleans(), init=st.sampled_from([0.1, 0.25])),
}
# The classes in torch.nn.modules.activation that are not elementwise.
NOT_ELEMENTWISE = {"GLU", "MultiheadAttention", "Softmax", "Softmin", "Softmax2d", "LogSoftmax"}


# --- architectures ----------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """``Linear(bias)`` -> optional norm -> activation -> optional eval-mode Dropout."""

    width: int
    bias: bool
    norm: str | None  # None, "batchnorm" or "layernorm"
    act: Act
    dropout: float | None


@dataclass(frozen=True)
class Case:
    """One generated ensemble: architecture, members, inputs and optimizer."""

    d_in: int
    blocks: tuple[Block, ...]
    vocab: int | None  # an Embedding in front (tokens in, summed over the sequence)
    padding_idx: int | None
    tied: bool  # two square Linear layers sharing one weight
    scalar: bool  # a 0-dim learnable temperature
    int_buffers: bool  # an integer permutation buffer and an int64 call counter
    frozen: tuple[int, ...]  # indices of blocks whose Linear is requires_grad=False
    train: bool
    bn_eps: float
    bn_momentum: float | None
    num_members: int
    dtype: torch.dtype
    batch: int
    per_member: bool  # inputs (and targets) with a member axis, in_dims=0
    chunk_size: int | None
    seed: int
    # optimizer (training properties only)
    decoupled: bool = False  # AdamW
    amsgrad: bool = False
    per_member_hyper: tuple[str, ...] = ()  # which of lr, betas, eps, weight_decay
    weight_decay: bool = False
    steps: int = 1
    in_place: bool = False  # update_ instead of update + apply_updates

    @property
    def d_out(self) -> int:
        return self.blocks[-1].width

    @property
    def plain(self) -> bool:
        """Whether the members are a bare nn.Sequential (the fast path's territory)."""
        return not (self.vocab or self.tied or self.scalar or self.int_buffers)

    @property
    def in_dims(self) -> int | None:
        return 0 if self.per_member else None


class GenNet(nn.Module):
    """The generated architecture when it is more than a bare nn.Sequential."""

    def __init__(self, case: Case, body: nn.Sequential) -> None:
        super().__init__()
        d = case.d_in
        if case.vocab is not None:
            self.emb = nn.Embedding(case.vocab, d, padding_idx=case.padding_idx)
        if case.int_buffers:
            self.register_buffer("perm", torch.randperm(d))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.body = body
        if case.tied:
            self.t1 = nn.Linear(case.d_out, case.d_out)
            self.t2 = nn.Linear(case.d_out, case.d_out, bias=False)
            self.t2.weight = self.t1.weight
        if case.scalar:
            self.temp = nn.Parameter(torch.rand(()) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(self, "emb"):
            e = self.emb(x)  # [..., 3 tokens, d_in], weighted by position
            x = e[..., 0, :] + 0.5 * e[..., 1, :] + 0.25 * e[..., 2, :]
        if hasattr(self, "perm"):
            x = x[..., self.perm]
            if self.training:
                self.calls.add_(1)
        x = self.body(x)
        if hasattr(self, "t1"):
            x = self.t2(torch.tanh(self.t1(x)))
        if hasattr(self, "temp"):
            x = x * self.temp
        if hasattr(self, "calls"):
            x = x * (1 + 0.25 * self.calls)
        return x


def build_member(case: Case, index: int) -> nn.Module:
    """Member ``index`` of ``case``: an ordinary module, seeded by case and index."""
    torch.manual_seed(case.seed * 1000 + index)
    layers: list[nn.Module] = []
    width = case.d_in
    for k, block in enumerate(case.blocks):
        linear = nn.Linear(width, block.width, bias=block.bias)
        if k in case.frozen:
            linear.requires_grad_(False)
        layers.append(linear)
        if block.norm == "batchnorm":
            bn = nn.BatchNorm1d(block.width, eps=case.bn_eps, momentum=case.bn_momentum)
            with torch.no_grad():  # non-trivial statistics, so eval mode exercises them
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
            layers.append(bn)
        elif block.norm == "layernorm":
            ln = nn.LayerNorm(block.width)
            with torch.no_grad():
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)
            layers.append(ln)
        layers.append(block.act.build(block.width))
        if block.dropout is not None:
            layers.append(nn.Dropout(block.dropout))
        width = block.width
    body = nn.Sequential(*layers)
    module = body if case.plain else GenNet(case, body)
    module = module.to(case.dtype).train(case.train)
    for sub in module.modules():
        if isinstance(sub, (nn.Dropout, nn.RReLU)):
            sub.eval()  # random layers run in eval mode: the loop's draws are not vmap's
    return module


def build_members(case: Case) -> list[nn.Module]:
    return [build_member(case, i) for i in range(case.num_members)]


def batch(case: Case, step: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets of ``step``: ``[B, ...]`` shared, or ``[N, B, ...]`` per member."""
    g = torch.Generator().manual_seed(case.seed * 7919 + step)
    lead = (case.num_members, case.batch) if case.per_member else (case.batch,)
    if case.vocab is not None:
        # Distinct sequences in every batch: two equal samples make the centred batch
        # rank-deficient, and BatchNorm's gradients then degenerate (see blocks()).
        rows = [
            torch.randperm(case.vocab**3, generator=g)[: case.batch]
            for _ in range(lead[0] if case.per_member else 1)
        ]
        codes = torch.stack(rows).reshape(*lead)
        x = torch.stack([codes // case.vocab**k % case.vocab for k in range(3)], dim=-1)
    else:
        x = torch.randn(*lead, case.d_in, generator=g, dtype=torch.float64).to(case.dtype)
    y = torch.randn(*lead, case.d_out, generator=g, dtype=torch.float64).to(case.dtype)
    return x, y


def member_batch(case: Case, x: Tensor, y: Tensor, i: int) -> tuple[Tensor, Tensor]:
    return (x[i], y[i]) if case.per_member else (x, y)


@dataclass(frozen=True)
class Hypers:
    """Per-member hyperparameters as Python floats (for torch.optim) and as given to fe."""

    lr: list[float]
    beta1: list[float]
    beta2: list[float]
    eps: list[float]
    weight_decay: list[float]

    def member(self, i: int) -> dict[str, object]:
        return {
            "lr": self.lr[i],
            "betas": (self.beta1[i], self.beta2[i]),
            "eps": self.eps[i],
            "weight_decay": self.weight_decay[i],
        }


def hypers(case: Case) -> Hypers:
    """Per-member values where ``case.per_member_hyper`` says so, else one shared value."""
    g = torch.Generator().manual_seed(case.seed * 104729 + 1)
    n = case.num_members

    def draw(name: str, make: Callable[[], float]) -> list[float]:
        if name in case.per_member_hyper:
            return [make() for _ in range(n)]
        return [make()] * n

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=g, dtype=torch.float64).item()

    wd = case.weight_decay or case.decoupled
    return Hypers(
        lr=draw("lr", lambda: math.exp(uniform(math.log(1e-3), math.log(1e-1)))),
        beta1=draw("betas", lambda: uniform(0.5, 0.95)),
        beta2=draw("betas", lambda: uniform(0.9, 0.9999)),
        eps=draw("eps", lambda: math.exp(uniform(math.log(1e-8), math.log(1e-6)))),
        weight_decay=draw("weight_decay", lambda: uniform(0.0, 0.1) if wd else 0.0),
    )


def fe_hyper(case: Case, values: list[float], name: str) -> float | Tensor:
    """The form fe.optim takes: a ``[N]`` float64 tensor if per member, else the float."""
    key = "betas" if name.startswith("beta") else name
    if key in case.per_member_hyper:
        return torch.tensor(values, dtype=torch.float64)
    return values[0]


# --- the strategies ---------------------------------------------------------------------


@st.composite
def activations(draw: st.DrawFn) -> Act:
    return draw(st.sampled_from(sorted(ACTIVATIONS)).flatmap(ACTIVATIONS.__getitem__))


@st.composite
def blocks(draw: st.DrawFn, *, train: bool, rank1: bool, first: bool) -> Block:
    norms = [None, None, "batchnorm", "layernorm"]
    if train and not first and not rank1:
        # BatchNorm in train mode cancels a per-channel shift of its input, and a bias
        # of an earlier layer shifts it whenever the activations between are in a
        # linear region (ReLU, Hardsigmoid, ...): that bias's gradient is then 0 in
        # exact arithmetic, i.e. rounding noise (see below). Train-mode BatchNorm goes
        # in the first block only, after the bias-free input layer.
        norms.remove("batchnorm")
    if rank1:
        # BatchNorm (train mode) over features that are affine in one scalar per sample
        # (e.g. Linear(1, w)) is invariant to them, and LayerNorm over a bias-free
        # Linear(1, w) is invariant to that scalar's size: the gradients before them
        # are 0 in exact arithmetic, i.e. pure rounding noise, which no two
        # implementations share (and Adam turns into lr-sized steps).
        norms.remove("layernorm")
        if train:
            norms.remove("batchnorm")
    norm = draw(st.sampled_from(norms))
    # LayerNorm over 1 or 2 features is (nearly) constant: its input gradients are
    # rounding noise, which Adam would blow up to lr-sized steps in both runs alike.
    # Train-mode BatchNorm of one channel over a few samples is a function of one
    # number (where the samples sit relative to each other): its gradients cancel
    # heavily, beyond float32's resolution. Two or more channels.
    low = {"layernorm": 3, "batchnorm": 2 if train else 1}.get(norm, 1)  # type: ignore[arg-type]
    width = draw(st.integers(low, 5))
    # A bias right before BatchNorm in train mode has a gradient that is exactly 0 in
    # exact arithmetic, i.e. rounding noise (the loop's and ours differ), which Adam
    # turns into lr-sized steps of random sign: no bias there, as in practice.
    bias = False if (norm == "batchnorm" and train) else draw(st.booleans())
    dropout = draw(st.sampled_from([None, None, 0.0, 0.5]))
    return Block(width, bias, norm, draw(activations()), dropout)


@st.composite
def cases(draw: st.DrawFn, *, training: bool = False, max_members: int = 64) -> Case:
    """A generated ensemble with its inputs, and with ``training`` an optimizer setup."""
    train = draw(st.booleans())
    depth = draw(st.integers(1, 3))
    d_in = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 7)) if draw(st.booleans()) else None
    # The inputs span at most vocab - 1 dimensions after an Embedding (a sequence's
    # embeddings are an affine combination of the vocab rows): that is the first
    # block's input width, as far as BatchNorm's degenerate case goes (see blocks()).
    # Once the features have passed through a width of 1 they stay rank-1 (an
    # elementwise activation of a scalar is often affine in it), so no later block may
    # have BatchNorm either.
    narrow = (d_in if vocab is None else min(d_in, vocab - 1)) == 1
    bs: tuple[Block, ...] = ()
    for k in range(depth):
        bs += (draw(blocks(train=train, rank1=narrow, first=k == 0)),)
        narrow = narrow or bs[-1].width == 1
    padding_idx = draw(st.none() | st.integers(0, vocab - 1)) if vocab is not None else None
    per_member = draw(st.booleans())
    frozen: tuple[int, ...] = ()
    if depth > 1 and draw(st.booleans()):
        # Not every layer: with nothing to train, loss.backward() fails in the loop too.
        layers = st.integers(0, depth - 1)
        frozen = tuple(sorted(draw(st.sets(layers, min_size=1, max_size=depth - 1))))
    has_bn = any(b.norm == "batchnorm" for b in bs)
    momentum = draw(st.sampled_from([0.1, 0.5, None])) if has_bn else 0.1
    n = draw(st.integers(1, max_members))
    # BatchNorm in train mode needs more than one value per channel; with two, its
    # output is +-1 whatever the input, and with three its float32 gradients are
    # ill-conditioned (they cancel to a few ulps).
    batch_size = draw(st.integers(4 if (train and has_bn) else 1, 5))
    chunk = draw(st.none() | st.integers(1, n + 1))
    case = Case(
        d_in=d_in,
        blocks=bs,
        vocab=vocab,
        padding_idx=padding_idx,
        tied=draw(st.booleans()),
        scalar=draw(st.booleans()),
        int_buffers=draw(st.booleans()),
        frozen=frozen,
        train=train,
        bn_eps=draw(st.sampled_from([1e-5, 1e-3])) if has_bn else 1e-5,
        bn_momentum=momentum,
        num_members=n,
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        batch=batch_size,
        per_member=per_member,
        chunk_size=chunk,
        seed=draw(st.integers(0, 2**20)),
    )
    if not training:
        return case
    hyper = draw(st.sets(st.sampled_from(["lr", "betas", "eps", "weight_decay"])))
    return replace(
        case,
        decoupled=draw(st.booleans()),
        amsgrad=draw(st.booleans()),
        per_member_hyper=tuple(sorted(hyper)),
        weight_decay=draw(st.booleans()),
        steps=draw(st.integers(1, 3)),
        in_place=draw(st.booleans()),
    )


# --- attribute differences between members ----------------------------------------------


@dataclass(frozen=True)
class Difference:
    """Member ``member`` of an ensemble differs from member 0 in one non-tensor attribute."""

    kind: str  # the layer
    attribute: str
    value0: object
    value: object
    num_members: int
    member: int

    def build(self, i: int) -> nn.Module:
        value = self.value if i == self.member else self.value0
        torch.manual_seed(i)
        layer = {
            "LeakyReLU": lambda: nn.LeakyReLU(negative_slope=value),
            "ELU": lambda: nn.ELU(alpha=value),
            "GELU": lambda: nn.GELU(approximate=value),
            "Softplus": lambda: nn.Softplus(beta=value),
            "Hardtanh": lambda: nn.Hardtanh(max_val=value),
            "Dropout": lambda: nn.Dropout(p=value),
            "BatchNorm1d.eps": lambda: nn.BatchNorm1d(4, eps=value),
            "BatchNorm1d.momentum": lambda: nn.BatchNorm1d(4, momentum=value),
            "LayerNorm": lambda: nn.LayerNorm(4, eps=value),
            "Softmax": lambda: nn.Softmax(dim=value),
        }[self.kind]()
        return nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2))


_DIFFERENCES: dict[str, tuple[str, st.SearchStrategy]] = {
    "LeakyReLU": ("negative_slope", st.sampled_from([0.01, 0.1, 0.2, 0.5])),
    "ELU": ("alpha", st.sampled_from([0.5, 1.0, 2.0])),
    "GELU": ("approximate", st.sampled_from(["none", "tanh"])),
    "Softplus": ("beta", st.sampled_from([0.5, 1.0, 2.0])),
    "Hardtanh": ("max_val", st.sampled_from([0.5, 1.0, 2.0])),
    "Dropout": ("p", st.sampled_from([0.0, 0.1, 0.5])),
    "BatchNorm1d.eps": ("eps", st.sampled_from([1e-5, 1e-3, 0.1])),
    "BatchNorm1d.momentum": ("momentum", st.sampled_from([0.1, 0.01, 0.5])),
    "LayerNorm": ("eps", st.sampled_from([1e-5, 1e-3, 0.1])),
    "Softmax": ("dim", st.sampled_from([0, 1])),
}


@st.composite
def differences(draw: st.DrawFn) -> Difference:
    kind = draw(st.sampled_from(sorted(_DIFFERENCES)))
    attribute, values = _DIFFERENCES[kind]
    value0 = draw(values)
    value = draw(values.filter(lambda v: v != value0))
    n = draw(st.integers(2, 8))
    return Difference(kind, attribute, value0, value, n, draw(st.integers(1, n - 1)))
