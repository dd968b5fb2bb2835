"""Translation jobs: runs of peer pages translated off SGLang's prefetch I/O thread (pure; no
sglang).

SGLang 0.5.23 runs one hit-query thread and one I/O thread per engine: a backend that translates
inside ``batch_get_v1`` holds every later prefetch of the engine, native ones included, for as
long as it translates. KVMapStorage instead starts a job when the hit query (``batch_exists``)
promises a translated run, so translation overlaps everything queued before it; the transfer
(``batch_get_v1``) only waits for its job, never past the job's deadline, and copies the
result into the host slots SGLang allocated.

Bounded: at most ``slots`` jobs are admitted at once (each on a worker thread of its own, and
each holding its translated pages until the transfer takes them or the job expires); a swap
that finds every slot taken is not translated (the caller counts it). A job past its deadline
stops at its next step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

EXPIRY_GRACE_S = 30.0  # how long a finished job's pages wait for a transfer without a deadline


@dataclass(eq=False)
class Job:
    """One run of pages being translated. keys: the page keys, in order; deadline: monotonic
    seconds after which the transfer stops waiting for it (inf: no deadline); future: the
    work's result."""

    keys: list[str]
    deadline: float
    future: Future = field(default_factory=Future)
    expired: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _done_at: float = 0.0

    def stopped(self) -> bool:
        """Whether the work should stop: cancelled, or past its deadline."""
        return self._stop.is_set() or time.monotonic() > self.deadline

    def cancel(self) -> None:
        self._stop.set()

    def wait(self) -> Any | None:
        """The work's result, waiting at most until the deadline; None if it is not done by
        then (the work is told to stop)."""
        timeout = None if self.deadline == float("inf") else self.deadline - time.monotonic()
        try:
            return self.future.result(timeout=max(0.0, timeout) if timeout is not None else None)
        except TimeoutError:
            self.cancel()
            return None

    def expires_at(self) -> float:
        """When an untaken result may be dropped: at the deadline, or a grace after it finished
        when it has none."""
        if self.deadline != float("inf"):
            return self.deadline
        return self._done_at + EXPIRY_GRACE_S if self.future.done() else float("inf")


class JobPool:
    """At most ``slots`` admitted jobs, run on as many worker threads."""

    def __init__(self, slots: int):
        self.slots = slots
        self._workers = ThreadPoolExecutor(slots, thread_name_prefix="kvmap-translate")
        self._admitted: list[Job] = []
        self._lock = threading.Lock()

    def submit(self, keys: list[str], deadline: float, work: Callable[[Job], Any]) -> Job | None:
        """Admit and start ``work(job)`` for ``keys``; None when every slot is taken."""
        with self._lock:
            if len(self._admitted) >= self.slots:
                return None
            job = Job(list(keys), deadline)
            self._admitted.append(job)
        self._workers.submit(self._run, job, work)
        return job

    def release(self, job: Job) -> None:
        """The transfer took the job's result (or gave up on it): free its slot."""
        job.cancel()
        with self._lock:
            if job in self._admitted:
                self._admitted.remove(job)

    def expire(self, now: float | None = None) -> list[Job]:
        """Release and return the jobs whose results nobody took in time."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [job for job in self._admitted if job.expires_at() < now]
            for job in old:
                job.expired = True
                self._admitted.remove(job)
        for job in old:
            job.cancel()
        return old

    def busy(self) -> int:
        with self._lock:
            return len(self._admitted)

    def close(self) -> None:
        with self._lock:
            for job in self._admitted:
                job.cancel()
            self._admitted.clear()
        self._workers.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _run(job: Job, work: Callable[[Job], Any]) -> None:
        try:
            if job.stopped():
                raise TimeoutError("the job's deadline passed before it started")
            result = work(job)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the job
            job._done_at = time.monotonic()
            job.future.set_exception(error)
        else:
            job._done_at = time.monotonic()
            job.future.set_result(result)
