"""``nn.Embedding`` members (padding_idx, max_norm, scale_grad_by_freq) against the loop."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe

N, ROWS, DIM, STEPS = 3, 7, 4, 3
TOL = {"rtol": 1e-9, "atol": 1e-11}


def make_members(**options) -> list[nn.Module]:
    torch.manual_seed(0)
    members = []
    for _ in range(N):
        m = nn.Sequential(nn.Embedding(ROWS, DIM, **options), nn.Tanh(), nn.Linear(DIM, 1))
        with torch.no_grad():  # rows well outside max_norm, padding rows not zero
            m[0].weight.normal_(0.0, 2.0)
        members.append(m.double())
    return members


def indices(per_member: bool) -> torch.Tensor:
    """Indices hitting the padding rows 0 and ROWS - 1, and repeats (for the frequencies)."""
    torch.manual_seed(1)
    idx = torch.randint(0, ROWS, (N, 10) if per_member else (10,))
    idx[..., :2] = 0
    idx[..., 2] = ROWS - 1
    idx[..., 3:5] = 3
    return idx


def targets() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(N, 10, 1, dtype=torch.float64)


def loop_grads(members, idx, y, per_member):
    out = []
    for i, m in enumerate(members):
        loss = F.mse_loss(m(idx[i] if per_member else idx), y[i])
        names = [k for k, _ in m.named_parameters()]
        out.append(dict(zip(names, torch.autograd.grad(loss, list(m.parameters())), strict=True)))
    return {k: torch.stack([g[k] for g in out]) for k in out[0]}


def stacked(members) -> dict[str, torch.Tensor]:
    return {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in members])
        for k, _ in members[0].named_parameters()
    }


OPTIONS = [
    {},
    {"padding_idx": 0},
    {"padding_idx": -1},
    {"padding_idx": 0, "scale_grad_by_freq": True},
    {"scale_grad_by_freq": True},
    {"max_norm": 1.0},
    {"max_norm": 1.5, "norm_type": 1.0, "padding_idx": 0},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_value_and_grad_training_matches_loop(options, per_member, chunk_size):
    members = make_members(**options)
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    idx, y = indices(per_member), targets()
    loop_opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in members]
    opt = fe.optim.adam(lr=0.1)
    state = opt.init(params)

    def loss_fn(p, b, idx, y):
        return F.mse_loss(fmodel(p, b, idx), y)

    step = fe.value_and_grad(loss_fn, (0 if per_member else None, 0), chunk_size=chunk_size)
    for _ in range(STEPS):
        ref = loop_grads(members, idx, y, per_member)  # max_norm renormalises in place here
        _, grads, buffers = step(params, buffers, idx, y)  # and here, member by member
        torch.testing.assert_close(params, stacked(members), **TOL)
        torch.testing.assert_close(grads, ref, **TOL)
        for i, (m, o) in enumerate(zip(members, loop_opts, strict=True)):
            o.zero_grad()
            F.mse_loss(m(idx[i] if per_member else idx), y[i]).backward()
            o.step()
        state = opt.update_(grads, state, params)
    torch.testing.assert_close(params, stacked(members), **TOL)
    padding = options.get("padding_idx")
    if padding is not None:  # no gradient reached any member's padding row
        assert not grads["0.weight"][:, padding].any()


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_module_face_training_matches_loop(options, per_member):
    members = make_members(**options)
    ens = fe.Ensemble(copy.deepcopy(members))
    opt = torch.optim.Adam(ens.parameters(), lr=0.1)
    loop_opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in members]
    idx, y = indices(per_member), targets()
    for _ in range(STEPS):
        opt.zero_grad()
        out = ens(idx, in_dims=0 if per_member else None)
        sum(F.mse_loss(out[i], y[i]) for i in range(N)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(members, loop_opts, strict=True)):
            o.zero_grad()
            F.mse_loss(m(idx[i] if per_member else idx), y[i]).backward()
            o.step()
    got = {k: v.detach() for k, v in ens.stacked_params().items()}
    torch.testing.assert_close(got, stacked(members), **TOL)


def test_padding_rows_of_every_member_get_no_gradient():
    """The regression: members 1..N-1 trained their padding row (0.72 apart after a step)."""
    fmodel, params, buffers = fe.stack(make_members(padding_idx=0))
    idx = indices(per_member=True)
    _, grads, _ = fe.value_and_grad(lambda p, b, i: fmodel(p, b, i).sum(), 0)(params, buffers, idx)
    assert torch.equal(grads["0.weight"][:, 0], torch.zeros(N, DIM, dtype=torch.float64))
    assert grads["0.weight"][:, 3].abs().min() > 0  # other rows do train


def test_sparse_gradients_are_refused_for_training_but_inference_runs():
    members = make_members(sparse=True)
    fmodel, params, buffers = fe.stack(members)
    idx = indices(per_member=False)
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"sparse=True is not supported .* expected sparse=False"):
        fe.value_and_grad(lambda p, b, i: fmodel(p, b, i).sum())(params, buffers, idx)
    torch.testing.assert_close(params, before, rtol=0, atol=0)
    with torch.no_grad():
        out = fe.vmap(fmodel)(params, buffers, idx)
    ref = torch.stack([m(idx) for m in members]).detach()
    torch.testing.assert_close(out, ref, **TOL)


def test_max_norm_inside_another_transform_is_refused_before_anything_changes():
    fmodel, params, buffers = fe.stack(make_members(max_norm=1.0))
    before = {k: v.clone() for k, v in params.items()}
    idx = indices(per_member=False)

    def losses(i):
        return fe.value_and_grad(lambda p, b, i: fmodel(p, b, i).sum())(params, buffers, i)[0]

    with pytest.raises(NotImplementedError, match=r"max_norm.*not under torch.compile, inside"):
        torch.func.vmap(losses)(idx.unsqueeze(0))
    torch.testing.assert_close(params, before, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"padding_idx": 0}, {"max_norm": 1.0}], ids=str)
@pytest.mark.parametrize("bad", [ROWS, -1], ids=["past-the-end", "negative"])
@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("face", ["module", "vmap", "value_and_grad"])
def test_an_index_outside_a_members_table_is_refused_naming_the_member(
    options, bad, face, chunk_size
):
    # vmap's own rule looks every member up in one flat table: member 1's index ROWS
    # would read member 2's row 0, and -1 member 0's last row. The loop raises.
    members = make_members(**options)
    idx = indices(per_member=True)
    idx[2, 4] = bad  # in the second chunk of 2: named as member 2, not the chunk's 0
    with pytest.raises(IndexError):
        members[2](idx[2])
    fmodel, params, buffers = fe.stack(members)
    before = {k: v.clone() for k, v in params.items()}
    message = rf"index {bad} in member 2's indices is out of range for a table of {ROWS} rows"
    with pytest.raises(IndexError, match=message):
        if face == "module":
            fe.Ensemble(members, chunk_size=chunk_size)(idx, in_dims=0)
        elif face == "vmap":
            fe.vmap(fmodel, in_dims=(0,), chunk_size=chunk_size)(params, buffers, idx)
        else:
            loss = lambda p, b, i: fmodel(p, b, i).sum()  # noqa: E731
            vg = fe.value_and_grad(loss, in_dims=(0,), chunk_size=chunk_size)
            vg(params, buffers, idx)
    # Nothing was renormalised (max_norm) in the failing call: in any member, or with
    # chunks in the failing chunk's (the chunks before it ran, as the loop's members
    # before the failing one would have).
    kept = slice(None) if chunk_size is None else slice(2, None)
    torch.testing.assert_close(
        {k: v[kept] for k, v in params.items()},
        {k: v[kept] for k, v in before.items()},
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("options", [{}, {"max_norm": 1.0}], ids=str)
def test_a_shared_index_outside_the_table_is_refused_before_anything_changes(options):
    members = make_members(**options)
    idx = indices(per_member=False)
    idx[3] = ROWS  # the flat table has N * ROWS rows: vmap's rule would read member 1's
    ens = fe.Ensemble(members)
    before = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    with pytest.raises(IndexError, match=rf"index {ROWS} in a shared index is out of range"):
        ens(idx)
    torch.testing.assert_close(
        {k: v.detach() for k, v in ens.stacked_params().items()}, before, rtol=0, atol=0
    )


def test_max_norm_tied_to_a_decoder_with_chunks_as_unsupported_md_says():
    """unsupported.md: a max_norm embedding tied to a decoder, with the module face's
    chunk_size, stops at backward (each chunk renormalises rows of the one stacked
    weight another chunk saved); fe.value_and_grad with chunk_size trains as the loop."""

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(11, 6, max_norm=1.0)
            self.d = nn.Linear(6, 11, bias=False)
            self.d.weight = self.e.weight

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return self.d(self.e(i))

    torch.manual_seed(0)
    members = [TiedLM().double() for _ in range(3)]
    idx = torch.randint(0, 11, (4, 7))
    loop = copy.deepcopy(members)
    torch.stack([m(idx) for m in loop]).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fe.Ensemble(copy.deepcopy(members), chunk_size=2)(idx).sum().backward()
    fmodel, params, buffers = fe.stack(members)
    params = {k: v.detach() for k, v in params.items()}
    _, grads, _ = fe.value_and_grad(lambda p, b, i: fmodel(p, b, i).sum(), chunk_size=2)(
        params, buffers, idx
    )
    for name, g in grads.items():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
