"""Translation jobs (sgl_kvmap/sglang/jobs.py): admission, deadlines, expiry."""

from __future__ import annotations

import math
import threading
import time

import pytest

from sgl_kvmap.sglang.jobs import JobPool


@pytest.fixture
def pool():
    jobs = JobPool(2)
    yield jobs
    jobs.close()


def test_jobs_run_side_by_side_up_to_the_slots(pool):
    started = threading.Barrier(3, timeout=5)

    def work(job):
        started.wait()  # both jobs must be running at once for this to pass
        return job.keys

    one = pool.submit(["a"], math.inf, work)
    two = pool.submit(["b"], math.inf, work)
    assert pool.submit(["c"], math.inf, work) is None  # every slot taken
    started.wait()
    assert one.wait() == ["a"] and two.wait() == ["b"]
    pool.release(one)
    assert pool.submit(["c"], math.inf, lambda job: 1) is not None


def test_a_job_past_its_deadline_is_not_waited_for_and_is_told_to_stop(pool):
    job = pool.submit(["a"], time.monotonic() + 0.2, lambda job: time.sleep(1) or "late")
    started = time.monotonic()
    assert job.wait() is None
    assert time.monotonic() - started < 0.9
    assert job.stopped()


def test_an_error_in_the_work_reaches_whoever_waits(pool):
    def work(job):
        raise OSError("disk gone")

    job = pool.submit(["a"], math.inf, work)
    with pytest.raises(OSError, match="disk gone"):
        job.wait()


def test_untaken_results_expire_and_free_their_slots(pool):
    done = pool.submit(["a"], time.monotonic() + 0.05, lambda job: 1)
    done.future.result(timeout=5)
    time.sleep(0.1)
    expired = pool.expire()
    assert expired == [done] and done.expired and pool.busy() == 0
