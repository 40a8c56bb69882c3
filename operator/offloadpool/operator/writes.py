"""A pass's writes of one kind sent several at once.

Why: a pass that finds 300 agents newly Ready marks 300 Nodes. One after another, each write
would wait for the API server's answer (tens of milliseconds on a busy server), so the pass
would take seconds of wall time for a fraction of a second of CPU, the pool's Ready would come
seconds after its last agent's, and the agents that turned Ready meanwhile would wait for the
next pass (docs/scale.md). The writes of one step of a pass are independent — one object each, each
idempotent — so they go out ``workers`` at a time, on the client's own connection pool
(``Kube.send`` is thread-safe). The pass waits for every one of them: what a pass wrote is in
the index before it goes on.

A failed write does not stop the others (they are independent); the caller takes in every
answer that came back, then raises the first failure, so the daemon retries the pass as when a
write failed one at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One write's answer, or what it raised."""

    answer: T | None = None
    error: Exception | None = None


@dataclass
class Batch(Generic[T]):
    """The outcomes of a list of writes, in the list's order, and the CPU that other threads
    spent sending them (0 when they ran in the calling thread, whose own time has it)."""

    outcomes: list[Outcome[T]]
    offloaded_cpu_seconds: float = 0.0

    def answered(self, items: Sequence[K]) -> Iterator[tuple[K, T | None]]:
        """Each item (what the write of the same place in the list was for) whose write
        succeeded, with its answer, in order."""
        for item, outcome in zip(items, self.outcomes, strict=True):
            if outcome.error is None:
                yield item, outcome.answer

    def raise_first(self) -> None:
        """Raise the first failure, if any (after the caller took in what succeeded)."""
        for outcome in self.outcomes:
            if outcome.error is not None:
                raise outcome.error


class ParallelWrites:
    """A small pool of threads kept for the process's passes (``workers`` at most in flight;
    1: every write in the calling thread)."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._executor: ThreadPoolExecutor | None = None

    def send(self, calls: Sequence[Callable[[], T]]) -> Batch[T]:
        """Run every call and wait for all of them. One call (or ``workers`` 1) runs in the
        calling thread: no thread hop for the common pass that writes one thing."""
        if len(calls) <= 1 or self.workers == 1:
            return Batch([_timed(call)[0] for call in calls])
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="offloadpool-write")
        timed = list(self._executor.map(_timed, calls))
        return Batch([outcome for outcome, _ in timed], sum(cpu for _, cpu in timed))


def _timed(call: Callable[[], T]) -> tuple[Outcome[T], float]:
    started = time.thread_time()
    try:
        outcome: Outcome[T] = Outcome(answer=call())
    except Exception as exc:  # raised again by the caller (Batch.raise_first), after the rest
        outcome = Outcome(error=exc)
    return outcome, time.thread_time() - started
