"""Stopping a kubelet plugin at a chosen step, so a test can kill it there for real.

``OFFLOADPOOL_CSI_STOP_AT=<step>`` (unset in any deployment) makes the plugin stop itself
(SIGSTOP) when it reaches that step of a publish or unpublish; the fault tests then kill -9 the
stopped process from outside and start another over the same records and mounts. As a
container's first process (the DaemonSet's plugin) the SIGSTOP it sends itself is dropped (the
kernel spares a namespace's init every signal it has no handler for), and the calling thread
waits forever instead: either way nothing more of that call is done before the kill. Nothing is
faked: the process dies between two real steps with whatever it did before on the node. Steps:

* ``recorded``: publish wrote the holder's record, nothing is mounted yet;
* ``staged``: publish bound the pool directory in its private stage, not yet the rest
  (nothing at the target);
* ``bound``: publish bound the whole tree at the target, its stage not yet detached;
* ``Scrubbing``: publish withheld the pool to zero it for a new holder, not yet zeroed;
* ``unbound``: unpublish detached the mounts, the record is still there.

The DRA plugin (``offloadpool.dra``) shares the record, the binds and this hook (the same
variable, set on its own DaemonSet): its prepare passes ``recorded``, ``staged`` and ``bound``
above, its unprepare ``unbound`` (the tree detached and its directory removed), and its own:

* ``reserved``: prepare reserved the allocated share, nothing recorded yet;
* ``cdi-staged``: prepare wrote the CDI spec under its temporary name, not yet renamed;
* ``cdi-written``: prepare wrote the CDI spec, everything done but the kubelet's answer;
* ``cdi-removed``: unprepare removed the CDI spec; the tree, reservation and record are there;
* ``unreserved``: unprepare dropped the reservation, the record is still there.

``OFFLOADPOOL_CSI_STOP_ONCE=<file>`` with it stops only the first time, the one that makes
``<file>``: a plugin the DaemonSet restarts in the same pod, with the same environment, finds
it and goes on, so the kubelet's retry can complete (the real-node fault tests).
"""

from __future__ import annotations

import os
import signal
import threading

STOP_AT_ENV = "OFFLOADPOOL_CSI_STOP_AT"
STOP_ONCE_ENV = "OFFLOADPOOL_CSI_STOP_ONCE"
RECORDED = "recorded"
STAGED = "staged"
BOUND = "bound"
UNBOUND = "unbound"
#: the DRA plugin's own steps (``dra.prepare``), in the order prepare and unprepare pass them
RESERVED = "reserved"
CDI_STAGED = "cdi-staged"
CDI_WRITTEN = "cdi-written"
CDI_REMOVED = "cdi-removed"
UNRESERVED = "unreserved"
#: every step a DRA prepare of a share passes, then an unprepare's
DRA_PREPARE_STEPS = (RESERVED, RECORDED, STAGED, BOUND, CDI_STAGED, CDI_WRITTEN)
DRA_UNPREPARE_STEPS = (CDI_REMOVED, UNBOUND, UNRESERVED)


def reached(step: str) -> None:
    """Stop here when the environment names ``step``; otherwise nothing."""
    if os.environ.get(STOP_AT_ENV) == step and _first_time():
        # to this thread, so that it is this thread that stops with its process at once, and
        # never goes on: a process-wide signal may be taken by another thread meanwhile; as a
        # namespace's init the signal is dropped, and the wait keeps the thread at the step
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        threading.Event().wait()


def _first_time() -> bool:
    """True unless ``STOP_ONCE_ENV`` names a file that exists already (made here if not)."""
    once = os.environ.get(STOP_ONCE_ENV)
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        return False
    return True
