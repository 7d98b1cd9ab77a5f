"""What is benchmarked: three ensembles of small models, their data and their FLOP counts.

Every member of an ensemble gets the same shared input batch ``x`` and its own target
``y[i]``; a training step minimises the sum over members of each member's own MSE, so
every member receives exactly the gradient it would get if trained alone.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def mlp(dims: tuple[int, ...], activation: type[nn.Module]) -> nn.Sequential:
    """``Linear(dims[0], dims[1]) - act - ... - Linear(dims[-2], dims[-1])``."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        if i:
            layers.append(activation())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


def small_cnn() -> nn.Sequential:
    """Two conv blocks with BatchNorm on 3x16x16 inputs, then a linear head with 10 outputs.

    The convolutions have no bias, as usual before BatchNorm: the normalisation would
    cancel it, its gradient is zero up to rounding, and Adam would turn that rounding
    into full-size steps that differ between otherwise equal implementations.
    """
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


@dataclass(frozen=True)
class Workload:
    """One benchmarked ensemble: member architecture, batch, member counts."""

    key: str
    title: str
    make_member: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample
    out_features: int
    batch: int
    sizes: tuple[int, ...]  # member counts N of a full run
    quick_sizes: tuple[int, ...]  # member counts N of a --quick run
    # Layer widths and activation when the member is a plain MLP (the hand-written
    # baselines, grouped Conv1d and baddbmm, exist only for those).
    mlp_dims: tuple[int, ...] | None = None
    activation: type[nn.Module] | None = None

    @property
    def is_mlp(self) -> bool:
        return self.mlp_dims is not None

    def members(
        self, n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> list[nn.Module]:
        """N freshly initialised members, the same for a given seed whatever the device."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [self.make_member().to(dtype=dtype, device=device) for _ in range(n)]

    def data(
        self,
        n: int,
        *,
        batch: int | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> tuple[Tensor, Tensor]:
        """Shared inputs ``x: [batch, *input_shape]`` and targets ``y: [n, batch, out]``."""
        g = torch.Generator().manual_seed(seed + 1)
        batch = self.batch if batch is None else batch
        x = torch.randn(batch, *self.input_shape, generator=g, dtype=dtype)
        y = torch.randn(n, batch, self.out_features, generator=g, dtype=dtype)
        return x.to(device), y.to(device)

    def layer_flops(self, batch: int | None = None) -> list[int]:
        """Forward multiply-add FLOPs (2 per MAC) of each Linear/Conv2d of one member."""
        batch = self.batch if batch is None else batch
        member = self.make_member().to("meta")
        counts: list[int] = []

        def count(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            if isinstance(module, nn.Linear):
                counts.append(2 * out.numel() * module.in_features)
            elif isinstance(module, nn.Conv2d):
                k = module.kernel_size[0] * module.kernel_size[1]
                counts.append(2 * out.numel() * module.in_channels // module.groups * k)

        hooks = [m.register_forward_hook(count) for m in member.modules()]
        member(torch.empty(batch, *self.input_shape, device="meta"))
        for h in hooks:
            h.remove()
        return counts

    def flops(self, n: int, *, train: bool) -> int:
        """Matmul/conv FLOPs of one inference forward or one training step of N members.

        Training is the forward, plus the weight gradients (as many FLOPs again) and the
        input gradients of every layer but the first. Elementwise ops, BatchNorm and
        Adam are not counted: they are a small share of the work but not of the time.
        """
        layers = self.layer_flops()
        per_member = 3 * sum(layers) - layers[0] if train else sum(layers)
        return n * per_member


WORKLOADS: dict[str, Workload] = {
    w.key: w
    for w in (
        Workload(
            key="S",
            title="S: Linear(8,32)-Tanh-Linear(32,4) heads, batch 256",
            make_member=lambda: mlp((8, 32, 4), nn.Tanh),
            input_shape=(8,),
            out_features=4,
            batch=256,
            sizes=(1, 8, 32, 128, 512),
            quick_sizes=(8, 128),
            mlp_dims=(8, 32, 4),
            activation=nn.Tanh,
        ),
        Workload(
            key="L",
            title="L: MLP 64-256-256-256-16 (ReLU), batch 256",
            make_member=lambda: mlp((64, 256, 256, 256, 16), nn.ReLU),
            input_shape=(64,),
            out_features=16,
            batch=256,
            sizes=(8, 32),
            quick_sizes=(8,),
            mlp_dims=(64, 256, 256, 256, 16),
            activation=nn.ReLU,
        ),
        Workload(
            key="C",
            title="C: CNN 2x(Conv3x3-BatchNorm-ReLU-MaxPool)-Linear on 3x16x16, batch 64",
            make_member=small_cnn,
            input_shape=(3, 16, 16),
            out_features=10,
            batch=64,
            sizes=(4, 16),
            quick_sizes=(4,),
        ),
    )
}
