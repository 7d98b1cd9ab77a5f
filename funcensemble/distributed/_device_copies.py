"""Joining per-device tensors on one device without making the devices wait for each other.

Every copy is issued with ``non_blocking=True``, all of them before any is waited for:

- to an accelerator, a copy is ordered on the streams involved (torch makes the
  destination's current stream wait for the source's), so nothing blocks the host
  and whatever runs next on the destination sees the copied values;
- to the CPU from CUDA, torch copies into pinned memory asynchronously; the host must
  not read the result before the copy is done, so after issuing every copy we wait once
  for each source device's current stream (the copies from several GPUs overlap);
- between CPU tensors (shards "on" the CPU, for testing) copies are plain and
  synchronous, and the shards have already run one after another.
"""

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device_async(tensors: Sequence[Tensor], target: torch.device) -> list[Tensor]:
    """``tensors`` on ``target``, safe for the host to read when this returns."""
    moved = [t.to(target, non_blocking=True) for t in tensors]
    if target.type == "cpu":
        wait_for_sources(tensors)
    return moved


def wait_for_sources(tensors: Sequence[Tensor]) -> None:
    """Block until the work queued so far on each tensor's CUDA device is done.

    Waits on each device's current stream, the one ``Tensor.to`` copied on, once per
    device.
    """
    seen: set[torch.device] = set()
    for t in tensors:
        if t.device.type == "cuda" and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()


def join_on(parts: Sequence[Sequence[Tensor]], target: torch.device) -> list[Tensor]:
    """``parts[k][j]`` is leaf j of shard k; returns each leaf concatenated over shards.

    All copies are issued first, then (for a CPU target) waited for once per device,
    then concatenated.
    """
    flat = [leaf for shard in parts for leaf in shard]
    moved = iter(to_device_async(flat, target))
    placed = [[next(moved) for _ in shard] for shard in parts]
    return [torch.cat([shard[j] for shard in placed]) for j in range(len(parts[0]))]
