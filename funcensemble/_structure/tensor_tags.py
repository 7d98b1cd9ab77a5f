"""The Python attributes users set on tensors (``p.no_decay = True``), torch's left out."""

from typing import Any

from torch import Tensor

# Attributes torch itself sets on tensors (torch.compile's marks, nn.Buffer, DDP, FSDP,
# optimizers in backward): bookkeeping of the run that set them, not the members' tags.
_TORCH_TENSOR_ATTRIBUTES = (
    "_dynamo",
    "_has_dynamo",
    "_is_param",
    "_is_buffer",
    "_ddp",
    "_fsdp",
    "_in_backward_optimizers",
    "_optimizer_classes",
    "_optimizer_kwargs",
    "_post_backward",
    "_saved_grad",
    "_cpu_grad",
    "_local_shard",
    "_sharded",
    "_sharding_spec",
)


def tensor_tags(t: Tensor) -> dict[str, Any]:
    """The Python attributes a user set on tensor ``t`` (torch's own left out)."""
    return {
        k: v
        for k, v in vars(t).items()
        if not k.startswith(_TORCH_TENSOR_ATTRIBUTES) and k != "persistent"
    }
