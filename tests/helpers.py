"""Shared test helpers: pytree comparisons, a model zoo, and a switch for runtime checks.

Other test modules append their own helpers below the existing ones.
"""

import contextlib
import copy
import functools
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jaxtyping
import optree
import pytest
import torch
from torch import Tensor, nn

# Float64 equivalence tolerances: vmap and a loop run the same math through different
# kernels (batched vs. per-member matmuls), so results agree to rounding, not bitwise.
RTOL = 1e-10
ATOL = 1e-12


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Tensor)


def _plain(tree: Any) -> Any:
    """Mappings as plain dicts, so a state_dict's OrderedDict compares with a dict."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_plain(v) for v in tree)
    return tree


def assert_trees_close(a: Any, b: Any, *, rtol: float, atol: float) -> None:
    """Assert two pytrees (dicts, tuples, lists, optree nodes) match leaf by leaf.

    Any mapping counts as a dict (key order ignored). Structures must be equal;
    tensors must match in shape, dtype and device and be close within ``rtol``/``atol``
    (``0``/``0`` asks for exact equality); any other leaf must compare equal. The
    failing leaf's path is in the message.
    """
    a, b = _plain(a), _plain(b)
    paths_a, leaves_a, spec_a = optree.tree_flatten_with_path(
        a, is_leaf=_is_leaf, none_is_leaf=True
    )
    leaves_b, spec_b = optree.tree_flatten(b, is_leaf=_is_leaf, none_is_leaf=True)
    assert spec_a == spec_b, f"pytree structures differ:\n{spec_a}\n{spec_b}"
    for path, x, y in zip(paths_a, leaves_a, leaves_b, strict=True):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            assert isinstance(x, Tensor) and isinstance(y, Tensor), f"at {path}: {x!r} vs {y!r}"
            torch.testing.assert_close(
                x.detach(),
                y.detach(),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                msg=lambda m, path=path: f"at {path}: {m}",
            )
        else:
            assert x == y, f"at {path}: {x!r} != {y!r}"


def assert_trees_equal(a: Any, b: Any) -> None:
    """``assert_trees_close`` with zero tolerance: bitwise-equal values, same dtypes."""
    assert_trees_close(a, b, rtol=0.0, atol=0.0)


def stack_trees(trees: list[Any]) -> Any:
    """Stack a list of same-structure pytrees of tensors along a new leading axis."""
    return optree.tree_map(lambda *xs: torch.stack(xs), *trees, is_leaf=_is_leaf)


def loop_outputs(modules: list[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """The reference: call each ordinary module in a Python loop and stack the outputs."""
    return stack_trees([m(*args, **kwargs) for m in modules])


def stacked_state(modules: list[nn.Module]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The members' parameters and buffers stacked by hand, for comparison."""
    params = [dict(m.named_parameters()) for m in modules]
    buffers = [dict(m.named_buffers()) for m in modules]
    return (
        {k: torch.stack([p[k].detach() for p in params]) for k in params[0]},
        {k: torch.stack([b[k] for b in buffers]) for k in buffers[0]},
    )


@contextlib.contextmanager
def runtime_typecheck_off() -> Iterator[None]:
    """Run a block as a user does: without the test run's jaxtyping+beartype checks.

    funcensemble validates its own inputs; this lets a test see those messages for
    wrong-typed inputs that beartype would otherwise reject first in the test run.
    """
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


# --- model zoo -------------------------------------------------------------------------


class TiedAutoencoder(nn.Module):
    """Token embedding and output head sharing one weight (tied embeddings)."""

    def __init__(self, vocab: int = 11, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class Tempered(nn.Module):
    """A linear layer followed by a learnable 0-dim temperature."""

    def __init__(self, d_in: int = 5, d_out: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.log_temp = nn.Parameter(torch.rand(()) - 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) / self.log_temp.exp()


class IntBuffers(nn.Module):
    """Integer buffers: BatchNorm's ``num_batches_tracked``, a permutation, a counter."""

    def __init__(self, features: int = 5) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(features)
        self.linear = nn.Linear(features, 3)
        self.register_buffer("perm", torch.randperm(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls.add_(1)
        return self.linear(self.bn(x[:, self.perm])) * (1 + self.calls)


class Snapshot(nn.Module):
    """Writes a differentiable value into its buffer in place (no ``.detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("snap", torch.zeros(2))

    def forward(self, x: Tensor) -> Tensor:
        self.snap.copy_(self.lin.bias * 2)
        return self.lin(x) + self.snap


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def make_cnn(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def make_transformer() -> nn.Module:
    return nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
    )


@dataclass(frozen=True)
class ZooModel:
    """One architecture: how to build a member and a batch of inputs for it."""

    name: str
    make: Callable[[], nn.Module]
    make_input: Callable[[torch.Generator], Tensor]

    def members(self, n: int, *, train: bool, dtype: torch.dtype = torch.float64) -> list:
        """``n`` distinct members (seeded by index) in train or eval mode."""
        out = []
        for i in range(n):
            torch.manual_seed(1000 + i)
            module = self.make().to(dtype)
            # Give BatchNorm non-trivial statistics so eval mode exercises them.
            for sub in module.modules():
                if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                    sub.running_mean.uniform_(-1, 1)
                    sub.running_var.uniform_(0.5, 2)
                    sub.weight.data.uniform_(0.5, 1.5)
                    sub.bias.data.uniform_(-0.5, 0.5)
            out.append(module.train(train))
        return out

    def input(self, seed: int = 0, *, dtype: torch.dtype = torch.float64) -> Tensor:
        x = self.make_input(torch.Generator().manual_seed(seed))
        return x.to(dtype) if x.is_floating_point() else x


def _randn(*shape: int) -> Callable[[torch.Generator], Tensor]:
    return lambda g: torch.randn(*shape, generator=g, dtype=torch.float64)


ZOO = {
    "mlp": ZooModel("mlp", make_mlp, _randn(7, 5)),
    "cnn": ZooModel("cnn", make_cnn, _randn(4, 2, 6, 6)),
    "transformer": ZooModel("transformer", make_transformer, _randn(3, 5, 8)),
    "tied": ZooModel("tied", TiedAutoencoder, lambda g: torch.randint(0, 11, (3, 6), generator=g)),
    "scalar_param": ZooModel("scalar_param", Tempered, _randn(7, 5)),
    "int_buffers": ZooModel("int_buffers", IntBuffers, _randn(6, 5)),
}


def clone_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """Independent deep copies, so a reference loop cannot see another run's updates."""
    return [copy.deepcopy(m) for m in modules]


# --- optimizers ------------------------------------------------------------------------


class OptimNet(nn.Module):
    """Everything an optimizer must handle: an unused parameter (its grad stays None),
    a 0-dim parameter, and BatchNorm (float buffers and an integer one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6, bias=False)  # BatchNorm cancels a bias here
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 2)
        self.unused = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x)))) * self.scale


def optim_net_members(n: int, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> list:
    """``n`` distinct OptimNets in train mode."""
    out = []
    for i in range(n):
        torch.manual_seed(seed * 1000 + i)
        out.append(OptimNet().to(dtype))
    return out


def optim_batch(step: int, member: int, *, dtype: torch.dtype = torch.float64) -> tuple:
    """Member ``member``'s regression batch ``(x, y)`` at ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(10_000 * step + member)
    return torch.randn(5, 4, generator=g, dtype=dtype), torch.randn(5, 2, generator=g, dtype=dtype)


def optim_loss(module: nn.Module, step: int, member: int) -> Tensor:
    x, y = optim_batch(step, member, dtype=module.fc1.weight.dtype)
    return ((module(x) - y) ** 2).mean()


# --- examples ----------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The examples import their shared examples/_cli.py, which `python examples/x.py` finds
# because Python puts a script's folder on sys.path; do the same for the tests.
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a fresh module (its ``main`` is then callable)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


# --- what older torch versions cannot do -----------------------------------------------
# The one place for tests that depend on the torch version: each was found by running the
# suite on the oldest supported version (`make test-oldest`), and docs/how-to/versions.md
# tells users the same.


@functools.cache
def dynamo_traces_optree() -> bool:
    """Whether ``torch.compile(fullgraph=True)`` traces optree's C functions.

    torch 2.6's Dynamo stops at them (``Unsupported``), so no ``fe.optim`` step
    compiles there.
    """

    def first_leaf_plus_one(tree: Any) -> Tensor:
        return optree.tree_leaves(tree)[0] + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's own note on the graph break
        try:
            compiled = torch.compile(first_leaf_plus_one, backend="eager", fullgraph=True)
            compiled({"a": torch.zeros(1)})
        except torch._dynamo.exc.Unsupported:
            return False
        finally:
            torch._dynamo.reset()
    return True


def skip_unless_dynamo_traces_optree() -> None:
    if not dynamo_traces_optree():
        pytest.skip(f"torch {torch.__version__}: Dynamo cannot trace optree (see versions.md)")


def dcp_save_alone(state: dict, path: Any) -> None:
    """``torch.distributed.checkpoint.save`` in this process alone, as plain DCP writes a
    checkpoint (torch 2.6 has no ``no_dist`` argument and decides it by itself)."""
    import inspect

    import torch.distributed.checkpoint as dcp

    alone = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that no process group is running
        dcp.save(state, checkpoint_id=path, **alone)


def dcp_load_alone(state: dict, path: Any) -> None:
    """``torch.distributed.checkpoint.load`` with its default planner, in this process alone."""
    import inspect

    import torch.distributed.checkpoint as dcp

    alone = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that no process group is running
        dcp.load(state, checkpoint_id=path, **alone)


def vmap_batches_matrix_exp() -> bool:
    """torch 2.6's vmap has no batching rule for ``matrix_exp`` (the default
    trivialization of ``parametrizations.orthogonal``; plain vmap loops over it with a
    warning, funcensemble refuses), nor has 2.7's; 2.8 and later have one (a one-off run
    of the suite on 2.7.1 found it missing)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.8"


def export_queries_vmapped_layout() -> bool:
    """Whether a non-strict ``torch.export`` of a call under ``vmap`` may stop in torch's
    own tracer first: on torch 2.6 it sometimes does (``RuntimeError``, "NYI: querying
    is_contiguous inside of vmap"), depending on Python's hash seed (PYTHONHASHSEED 12
    passes, 0 to 11 stop); 2.10 and later never did (2.7 to 2.9 were not checked)."""
    return torch.torch_version.TorchVersion(torch.__version__) < "2.10"
