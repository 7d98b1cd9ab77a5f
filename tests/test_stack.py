"""fe.stack / fe.unstack / fe.FunctionalModule: exact round trips and no aliasing."""

import re

import pytest
import torch
from helpers import ZOO, assert_trees_equal, runtime_typecheck_off, stacked_state
from torch import Tensor, nn

import funcensemble as fe
from funcensemble._structure.architecture import Architecture


def _storages(tensors: list[Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _with_frozen_and_mixed_modes(modules: list[nn.Module]) -> list[nn.Module]:
    """Freeze one parameter and put the first submodule in the opposite mode, in every member."""
    for m in modules:
        first_param = next(iter(m.parameters()))
        first_param.requires_grad_(False)
        children = list(m.children())
        if children:
            children[0].train(not m.training)
    return modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_stack_unstack_round_trip_is_exact(name: str, n: int, dtype: torch.dtype) -> None:
    modules = _with_frozen_and_mixed_modes(ZOO[name].members(n, train=True, dtype=dtype))
    fmodel, params, buffers = fe.stack(modules)
    expected_params, expected_buffers = stacked_state(modules)
    assert_trees_equal(params, expected_params)
    assert_trees_equal(buffers, expected_buffers)

    back = fe.unstack(fmodel, params, buffers)
    assert len(back) == n
    for original, copy_ in zip(modules, back, strict=True):
        assert type(copy_) is type(original)
        assert_trees_equal(dict(copy_.named_parameters()), dict(original.named_parameters()))
        assert_trees_equal(dict(copy_.named_buffers()), dict(original.named_buffers()))
        assert_trees_equal(copy_.state_dict(), original.state_dict())
        assert {k: p.requires_grad for k, p in copy_.named_parameters()} == {
            k: p.requires_grad for k, p in original.named_parameters()
        }
        assert all(isinstance(p, nn.Parameter) for p in copy_.parameters())
        assert {k: s.training for k, s in copy_.named_modules()} == {
            k: s.training for k, s in original.named_modules()
        }
        assert Architecture.of(copy_) == Architecture.of(original)
        x = ZOO[name].input(dtype=dtype)
        with torch.no_grad():
            assert_trees_equal(copy_.eval()(x), original.eval()(x))

    # stack(unstack(...)) gives back exactly the stacked tensors.
    _, params_again, buffers_again = fe.stack(back)
    assert_trees_equal(params_again, params)
    assert_trees_equal(buffers_again, buffers)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_unstacked_members_are_independent_contiguous_copies(name: str, n: int) -> None:
    fmodel, params, buffers = fe.stack(ZOO[name].members(n, train=True))
    back = fe.unstack(fmodel, params, buffers)
    stacked_storages = _storages(list(params.values()) + list(buffers.values()))
    seen: set[int] = set()
    for module in back:
        tensors = list(module.parameters()) + list(module.buffers())
        assert all(t.is_contiguous() for t in tensors)
        assert all(t.is_leaf and t.grad_fn is None for t in tensors)
        storages = _storages(tensors)
        assert len(storages) == len(tensors)  # distinct tensors never share storage
        assert not storages & stacked_storages
        assert not storages & seen
        seen |= storages
    # Writing into one member touches neither the stacked tensors nor the others.
    before = {k: v.clone() for k, v in params.items()}
    with torch.no_grad():
        for p in back[0].parameters():
            p.add_(1.0)
    assert_trees_equal(params, before)
    if n > 1:
        assert_trees_equal(dict(back[1].named_parameters()), {k: v[1] for k, v in before.items()})


def test_tied_weights_stay_tied() -> None:
    modules = ZOO["tied"].members(3, train=True)
    fmodel, params, _ = fe.stack(modules)
    assert "emb.weight" in params and "head.weight" not in params
    assert fmodel.skeleton.head.weight is fmodel.skeleton.emb.weight
    for module in fe.unstack(fmodel, params, {}):
        assert module.head.weight is module.emb.weight
        assert set(module.state_dict()) == {"emb.weight", "mix.weight", "mix.bias", "head.weight"}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_stacked_params_are_fresh_leaves_not_aliasing_inputs(name: str) -> None:
    modules = ZOO[name].members(3, train=True)
    fmodel, params, buffers = fe.stack(modules)
    inputs = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    stacked = list(params.values()) + list(buffers.values())
    assert not _storages(stacked) & _storages(inputs)
    for k, p in params.items():
        assert p.is_leaf and p.grad_fn is None and p.requires_grad, k
        assert p.is_contiguous()
    for k, b in buffers.items():
        assert not b.requires_grad, k
    # The skeleton holds no weights: its tensors are on the meta device.
    assert all(t.is_meta for t in (*fmodel.skeleton.parameters(), *fmodel.skeleton.buffers()))

    before = ({k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in buffers.items()})
    with torch.no_grad():
        for t in inputs:
            t.add_(1)
    assert_trees_equal((params, buffers), before)


def test_stack_does_not_mutate_or_detach_inputs() -> None:
    modules = ZOO["cnn"].members(2, train=True)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]
    ids = [[id(p) for p in m.parameters()] for m in modules]
    fe.stack(modules)
    for m, b, i in zip(modules, before, ids, strict=True):
        assert_trees_equal(m.state_dict(), b)
        assert [id(p) for p in m.parameters()] == i
        assert all(p.requires_grad for p in m.parameters())
        assert m.training


def test_stack_accepts_module_list_and_tuple() -> None:
    torch.manual_seed(0)
    heads = [nn.Linear(3, 2) for _ in range(3)]
    _, from_list, _ = fe.stack(heads)
    _, from_tuple, _ = fe.stack(tuple(heads))
    _, from_module_list, _ = fe.stack(nn.ModuleList(heads))
    assert_trees_equal(from_list, from_tuple)
    assert_trees_equal(from_list, from_module_list)


def test_functional_module_computes_one_member() -> None:
    modules = ZOO["cnn"].members(3, train=False)
    fmodel, params, buffers = fe.stack(modules)
    x = ZOO["cnn"].input()
    for i, module in enumerate(modules):
        one_p = {k: v[i] for k, v in params.items()}
        one_b = {k: v[i] for k, v in buffers.items()}
        assert_trees_equal(fmodel(one_p, one_b, x), module(x))
    assert repr(fmodel).startswith("FunctionalModule(Sequential(")


@pytest.mark.parametrize("switch", ["train", "eval"])
def test_functional_module_mode_switch_points_to_the_skeleton(switch: str) -> None:
    fmodel, _, _ = fe.stack([nn.Dropout(0.5) for _ in range(2)])
    with pytest.raises(
        AttributeError,
        match=rf"'FunctionalModule' object has no attribute '{switch}': .* \(expected "
        rf"fmodel\.skeleton\.{switch}\(\), got fmodel\.{switch}\(\)\)\. Call "
        rf"fmodel\.skeleton\.{switch}\(\)\.$",
    ):
        getattr(fmodel, switch)
    getattr(fmodel.skeleton, switch)()  # the documented switch
    assert fmodel.skeleton.training == (switch == "train")
    with pytest.raises(AttributeError, match=r"^'FunctionalModule' object has no attribute 'x'$"):
        fmodel.x  # noqa: B018  (any other attribute: the usual error)
    assert not hasattr(fmodel, switch)


def test_unstack_keeps_hooks_and_attributes() -> None:
    calls = []
    torch.manual_seed(0)
    modules = [nn.Linear(3, 2), nn.Linear(3, 2)]

    def hook(*_) -> None:
        calls.append(1)

    for module in modules:  # members must agree on hooks and attributes (test_architecture)
        module.register_forward_hook(hook)
        module.custom_attribute = "kept"
    fmodel, params, buffers = fe.stack(modules)
    back = fe.unstack(fmodel, params, buffers)
    back[1](torch.randn(4, 3))
    assert calls == [1]
    assert back[1].custom_attribute == "kept"


@pytest.mark.parametrize("argument", ["params", "buffers"])
def test_unstack_params_or_buffers_not_a_dict_is_a_type_error(argument) -> None:
    fmodel, params, buffers = fe.stack([nn.BatchNorm1d(2) for _ in range(3)])
    state = {"params": params, "buffers": buffers}
    state[argument] = list(state[argument].values())
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=rf"unstack: {argument} must be a dict .* got list"),
    ):
        fe.unstack(fmodel, state["params"], state["buffers"])


@pytest.mark.parametrize("missing", ["0.weight", "2.bias"])
def test_params_without_one_of_the_module_s_tensors_are_refused(missing) -> None:
    """functional_call(strict=False) would use the skeleton's own tensor in its place:
    meta for fe.stack, all members' stacked one for Ensemble.fmodel."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)) for _ in range(3)]
    x = torch.randn(3, 3)  # a batch of N rows: a stacked [N, ...] tensor would broadcast
    message = rf"parameter `{re.escape(missing)}` is in neither params nor buffers"
    for fmodel, params, buffers in (fe.stack(members), _ensemble_face(members)):
        partial = {k: v for k, v in params.items() if k != missing}
        with pytest.raises(ValueError, match="vmap: the module's " + message):
            fe.vmap(fmodel)(partial, buffers, x)
        with pytest.raises(ValueError, match="value_and_grad: the module's " + message):
            fe.value_and_grad(lambda p, b, x, f=fmodel: f(p, b, x).sum())(partial, buffers, x)
        one = {k: v[0] for k, v in partial.items()}
        with pytest.raises(ValueError, match="FunctionalModule: the module's " + message):
            fmodel(one, {k: v[0] for k, v in buffers.items()}, x)


def test_buffers_merged_into_params_are_refused_and_left_unchanged() -> None:
    """torch.func's functional_call(model, {**params, **buffers}, x) idiom: in params,
    BatchNorm's in-place updates would write the caller's tensors (value_and_grad no
    longer pure, a failed call not put back)."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)) for _ in range(2)]
    fmodel, params, buffers = fe.stack(members)
    before = {k: v.clone() for k, v in buffers.items()}
    merged = {**params, **buffers}
    x = torch.randn(5, 3)
    message = r"the buffer `1\.running_mean` was passed in params \(expected the buffers in"
    with pytest.raises(ValueError, match="value_and_grad: " + message):
        fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())(merged, {}, x)
    with pytest.raises(ValueError, match="vmap: " + message):
        fe.vmap(fmodel)(merged, {}, x)
    # Inside a loss, merged by the loss itself.
    with pytest.raises(ValueError, match="value_and_grad: " + message):
        fe.value_and_grad(lambda p, b, x: fmodel({**p, **b}, {}, x).pow(2).mean())(
            params, buffers, x
        )
    for name, t in buffers.items():
        assert torch.equal(t, before[name]), name


def test_tied_second_names_are_refused_and_a_loss_may_keep_its_own_keys() -> None:
    """A tied tensor's second name raised torch's functional_call error, which named an
    option funcensemble does not have. Other keys are left alone, as functional_call
    leaves them: a loss may keep its own tensor beside the model's (here a learned
    log-variance), and its gradient is the loop's."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double() for _ in range(2)]
    fmodel, params, buffers = fe.stack(members)
    params = {**params, "log_var": torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)}
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)

    def loss(p, b, x, y):
        return (((fmodel(p, b, x) - y) ** 2) * torch.exp(-p["log_var"]) + p["log_var"]).mean()

    for mapped in (fe.value_and_grad(loss), fe.value_and_grad(loss, chunk_size=1)):
        losses, grads, _ = mapped(params, buffers, x, y)
        for i, m in enumerate(members):
            log_var = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            m.zero_grad()
            one = (((m(x) - y) ** 2) * torch.exp(-log_var) + log_var).mean()
            one.backward()
            torch.testing.assert_close(losses[i], one.detach())
            torch.testing.assert_close(grads["log_var"][i], log_var.grad)
            torch.testing.assert_close(grads["0.weight"][i], m[0].weight.grad)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.dec = nn.Linear(3, 5, bias=False)
            self.dec.weight = self.emb.weight

        def forward(self, i):
            return self.dec(self.emb(i))

    fmodel, params, buffers = fe.stack([Tied() for _ in range(2)])
    both = {**params, "dec.weight": params["emb.weight"]}
    with pytest.raises(
        ValueError, match=r"a second name of the tied `emb\.weight`.*as `emb\.weight`"
    ):
        fe.vmap(fmodel)(both, buffers, torch.tensor([1, 2]))


def _ensemble_face(members):
    ens = fe.Ensemble(members)
    return ens.fmodel, dict(ens.stacked_params()), dict(ens.stacked_buffers())
