"""The all-gather the collectives use: no deprecation warning on any supported torch."""

import socket
import warnings

import torch
import torch.distributed as dist

from funcensemble.distributed._gather import all_gather_single


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_gather_single_gathers_without_a_warning():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        t = torch.arange(6.0).view(2, 3)
        out = torch.full((2, 3), -1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch 2.13 deprecates all_gather_into_tensor
            all_gather_single(out, t)
        assert torch.equal(out, t)
    finally:
        dist.destroy_process_group()
