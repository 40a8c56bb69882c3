"""The kopf handlers. They only decide WHEN a pool gets a pass; ``reconcile`` decides WHAT.

- every OffloadPool has a daemon that runs a pass when woken (a change to the pool's spec or
  deletion, to one of its OffloadPoolNodes, to any Node's labels/taints, or a pool mark lost)
  and at least every ``resync_seconds`` (stale heartbeats, objects deleted by hand); bursts are
  coalesced, and paced: after a pass that cost C CPU-seconds besides its writes the next waits
  at least C / ``pass_cpu_share`` (``OperatorConfig.pass_pause``), so a big pool's passes take
  a bounded share of a core however fast its agents report. Writes are left out of C: each is
  a change made once (a thousand Nodes marked cost a thousand writes however the passes fall),
  and pausing after them would only delay the pool's Ready by seconds. What the operator writes itself (pool
  status, marks on Nodes) wakes nothing, so passes do not beget passes; agents' heartbeats
  are Leases, which it does not watch;
- kopf watches the pools only. Nodes and OffloadPoolNodes — thousands of events while a big
  pool converges — are watched by ``watched`` (plain JSON in threads; see there why), which
  wakes the daemons through ``Runtime``; a daemon's first pass waits for both to be listed,
  so a restarted operator never mistakes "not listed yet" for "gone";
- the deletion handler holds the pool (finalizer) and runs deletion passes until every node
  still present reports Released (or never ran an agent of the pool: ``reconcile``), waiting
  between them in the handler (a wait is no error).

kopf stops a pool's daemon when the pool is marked for deletion, before the deletion handler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from offloadpool.api.constants import GROUP, POOL_PLURAL, VERSION

from . import endpoints
from . import settings as operator_settings
from .runtime import Runtime

log = logging.getLogger(__name__)


def _runtime(memo: kopf.Memo) -> Runtime:
    return memo["runtime"]


async def _sleep(wake: asyncio.Event | None, stopped: kopf.DaemonStopped, timeout: float) -> bool:
    """Sleep until ``wake`` is set, the daemon is stopped, or ``timeout``; True when woken."""

    async def until_stopped() -> None:
        await stopped.wait()

    waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(until_stopped())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return wake is not None and wake.is_set()


# Async on purpose: they run in the event loop, where the asyncio wake-up Events live (kopf
# would run a sync handler in a worker thread).
@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    runtime = _runtime(memo)
    if runtime.config.liveness:  # kopf's own would not be bounded (endpoints)
        memo["liveness"] = await endpoints.liveness(runtime.config.liveness, endpoints.HttpBounds())
    operator_settings.configure(settings, runtime.config)
    runtime.connect(asyncio.get_running_loop())
    logger.info("offloadpool operator: agent DaemonSets in namespace %s", runtime.config.namespace)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).stop()
    if memo.get("liveness") is not None:
        await memo["liveness"].cleanup()


@kopf.on.event(GROUP, VERSION, POOL_PLURAL)
async def pool_event(event: dict[str, Any], body: kopf.Body, name: str, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    if event.get("type") != "DELETED" and runtime.pool_changed(name, body):
        runtime.trigger(name)


@kopf.daemon(GROUP, VERSION, POOL_PLURAL, initial_delay=0)
async def pool_daemon(
    name: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Pass after pass over one pool until kopf stops the daemon (operator exit or deletion)."""
    runtime = _runtime(memo)
    config = runtime.config
    await runtime.synced()
    wake = runtime.trigger(name)
    failures = 0
    pause = config.debounce_seconds
    while not stopped:
        if await _sleep(wake, stopped, config.resync_seconds):
            await _sleep(None, stopped, pause)
        if stopped:
            break
        wake.clear()
        try:
            result = await asyncio.to_thread(runtime.connected().run, name)
            pause = config.pass_pause(result.paced_cpu_seconds if result is not None else 0.0)
            failures = 0
        except Exception:  # a pass that fails is retried; the daemon must never die
            failures += 1
            logger.exception("pass over pool %s failed (attempt %d); retrying", name, failures)
            await asyncio.sleep(config.failed_pass_delay(failures))
            wake.set()


@kopf.on.delete(GROUP, VERSION, POOL_PLURAL)
async def pool_deleted(name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Hold the pool until every node (that still exists) reports Released.

    The wait is a loop in the handler, not ``kopf.TemporaryError``: kopf logs every temporary
    failure at ERROR and posts it as an Error Event, and a deletion waiting for agents to
    release memory, or for an engine to let go of it, is the normal course of things (the
    pool's status and its WaitingForRelease Event say what it waits for). The wait is logged
    at INFO each time what it waits for changes."""
    runtime = _runtime(memo)
    await runtime.synced()
    said = None
    while True:
        result = await asyncio.to_thread(runtime.connected().run, name)
        if result is None or not result.unreleased:
            break
        message = result.status.get("conditions", [{}])[0].get("message", "waiting for nodes to release")
        if message != said:
            log.info("pool %s: %s", name, message)
            said = message
        await asyncio.sleep(runtime.config.deletion_retry_seconds)
    runtime.forget(name)
    logger.info("pool %s released on every node; finalizer removed", name)
