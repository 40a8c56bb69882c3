"""Stopping the plugin at a chosen step, so a test can kill it there for real.

``OFFLOADPOOL_CSI_STOP_AT=<step>`` (unset in any deployment) makes the plugin stop itself
(SIGSTOP) when it reaches that step of a publish or unpublish; the fault tests then kill -9 the
stopped process from outside and start another over the same records and mounts. Nothing is
faked: the process dies between two real steps with whatever it did before on the node. Steps:

* ``recorded``: publish wrote the holder's record, nothing is mounted yet;
* ``staged``: publish bound the pool directory in its private stage, not yet the rest
  (nothing at the target);
* ``bound``: publish bound the whole tree at the target, its stage not yet detached;
* ``Scrubbing``: publish withheld the pool to zero it for a new holder, not yet zeroed;
* ``unbound``: unpublish detached the mounts, the record is still there.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_AT_ENV = "OFFLOADPOOL_CSI_STOP_AT"
RECORDED = "recorded"
STAGED = "staged"
BOUND = "bound"
UNBOUND = "unbound"


def reached(step: str) -> None:
    """Stop here when the environment names ``step``; otherwise nothing."""
    if os.environ.get(STOP_AT_ENV) == step:
        # to this thread, so that it is this thread that stops with its process at once, and
        # never goes on: a process-wide signal may be taken by another thread meanwhile
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        threading.Event().wait()
