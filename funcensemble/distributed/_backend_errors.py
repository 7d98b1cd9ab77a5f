"""What to add to a ``DistributedError`` when the communication backend (NCCL) failed.

NCCL runs collectives asynchronously: a collective that never completes is noticed by
torch's watchdog thread, which by default ends the process
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``) rather than raising in the thread that called
the collective. Where it is raised in that thread (``TORCH_NCCL_BLOCKING_WAIT=1``, or
the next collective on an aborted communicator), torch raises a
``torch.distributed.DistBackendError``, which ``failures`` wraps like any other error;
this adds what the user can do about it.
"""

import torch.distributed as dist

NCCL_HINT = (
    "The communication backend reported the failure (with NCCL: a collective timed out "
    "or failed and the communicator was aborted). Run with NCCL_DEBUG=WARN for NCCL's own "
    "account; torch's NCCL watchdog ends a process whose collective times out unless "
    "TORCH_NCCL_BLOCKING_WAIT=1 is set, which raises the error here instead."
)


def backend_hint(cause: BaseException | None) -> str:
    """A sentence of advice for a backend (NCCL) failure; empty for anything else."""
    backend_error = getattr(dist, "DistBackendError", None)
    if cause is None:
        return ""
    if (backend_error is not None and isinstance(cause, backend_error)) or "NCCL" in str(cause):
        return " " + NCCL_HINT
    return ""
