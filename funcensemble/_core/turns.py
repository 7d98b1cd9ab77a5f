"""One lock per skeleton module, held by the calls that borrow it: they take turns.

A call off the fast path runs a member's ``forward`` on the skeleton module that every
call of one ensemble shares, with ``functional_call`` swapping the call's tensors into
it. Two threads doing that at once would run with each other's tensors (an output
silently wrong), where the loop's modules, called from several threads, compute each
call from its own inputs. So the calls borrowing one skeleton take turns, for the
length of one borrowing call (one chunk of a chunked call): other ensembles, and the
fast path, which borrows nothing, do not wait. The lock is reentrant: a forward may
call its own ensemble again.
"""

import threading
import weakref

from torch import nn

_locks: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_making = threading.Lock()


def lock(skeleton: nn.Module) -> threading.RLock:
    """The lock of the calls borrowing ``skeleton``."""
    found = _locks.get(skeleton)
    if found is None:
        with _making:  # (two threads' first calls must not make two locks)
            found = _locks.setdefault(skeleton, threading.RLock())
    return found
