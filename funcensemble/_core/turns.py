"""One lock for the calls that borrow a skeleton module: they take turns.

A call off the fast path runs a member's ``forward`` on the skeleton module that every
call of one ensemble shares: ``functional_call`` swaps the call's tensors into it, and a
chunked call replays its Python attributes chunk by chunk. Two threads doing that at
once would run with each other's tensors (an output silently wrong) or attributes,
where the loop's modules, called from several threads, compute each call from its own
inputs. So those calls take turns; the fast path, which borrows nothing, does not wait.

One lock for all ensembles rather than one per skeleton: a loss calling two ensembles
in chunks would hold one lock while waiting for the other, which another thread could
hold while waiting for the first. The lock is reentrant: a forward may call an
ensemble itself.
"""

import threading

LOCK = threading.RLock()
