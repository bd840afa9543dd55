"""The job-state store as a state machine (hypothesis ``RuleBasedStateMachine``) against a real
redis-server: random interleavings of start (plain and forced), progress, lease renewal,
succeed, fail (final or retryable), cancel, release, the start of a group's render (its size),
lease expiry with the reaper's requeue (bisection across attempts: charged only when the job
rendered alone), and dead-letter retry (refused after one for a job that killed its worker) —
including writes from stale attempts that must be discarded.

After every step the store must agree with a plain-Python model, and:
- a terminal state never changes (only a dead-letter retry takes ``failed`` back to ``queued``);
- a stale attempt's write changes nothing;
- ``attempts`` never decreases;
- the batch's per-state counters equal the jobs' states and add up to the total, and its
  ``done`` equals Σ progress with terminal jobs counting 1;
- the reaper's indexes agree: ``rf:leases`` holds exactly the running jobs, ``rf:pending`` the
  queued ones, ``rf:dead`` the failed ones.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, multiple, rule, run_state_machine_as_test

from infra import keys
from infra.schemas import JOB_STATES, TERMINAL_STATES, JobError, JobResult, RenderRequest
from infra.state.job_store import CANCELED, HELD, MAX_KILL_RETRIES, MAX_LOSSES, STALE, JobStore, NewJob, RetryRefused

pytestmark = pytest.mark.integration

JOBS = 3
MAX_ATTEMPTS = 3
DB = 3  # the farm's API (and its reaper) use database 0


@dataclass
class Model:
    state: str = "queued"
    attempts: int = 0
    attempt_base: int = 0
    progress: float = 0.0
    lease_expired: bool = False
    group: int = 0  # size of the group this attempt renders the job in (0: not rendering)
    losses: int = 0
    kills: int = 0
    kill_retries: int = 0

    @property
    def used(self) -> int:
        return self.attempts - self.attempt_base

    def lost(self) -> bool:
        """The worker of this attempt was lost: charged only when it rendered the job alone.
        Returns whether the job must fail now."""
        self.losses += 1
        if self.group == 1:
            self.kills += 1
        else:
            self.attempt_base += 1
        self.group = 0
        return self.used >= MAX_ATTEMPTS or self.losses >= MAX_LOSSES


class StoreMachine(RuleBasedStateMachine):
    """One batch of :data:`JOBS` jobs per run; handles of every attempt are kept, so later
    rules replay writes from attempts that have since gone stale."""

    client = None  # set by the test

    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.store = JobStore(self.client, lease_s=3600, max_attempts=MAX_ATTEMPTS)
        # renewing through this store sets the lease to now, i.e. the lease has expired
        self.expiring = JobStore(self.client, lease_s=0.0, max_attempts=MAX_ATTEMPTS)
        self.batch_id = secrets.token_hex(8)
        self.ids = [secrets.token_hex(8) for _ in range(JOBS)]
        request = RenderRequest(prompt="state machine", seed=1)
        self.store.create_batch(self.batch_id, [NewJob(j, request, "sm-pool") for j in self.ids])
        self.model = {j: Model() for j in self.ids}

    # -- helpers ----------------------------------------------------------------------------
    def _current(self, handle) -> bool:
        m = self.model[handle.job_id]
        return m.state == "running" and m.attempts == handle.attempt

    def _snapshot(self, job_id: str) -> dict:
        h = self.client.hgetall(keys.job(job_id))
        return {k: h.get(k) for k in ("state", "attempts", "progress", "result", "error", "worker")}

    # -- rules ------------------------------------------------------------------------------
    @rule(target=handles, i=st.integers(0, JOBS - 1), force=st.booleans())
    def start(self, i, force):
        job_id = self.ids[i]
        m = self.model[job_id]
        before = self._snapshot(job_id)
        out = self.store.start_many([job_id], f"w{i}", force=force)[job_id]
        takes_over = m.state == "running" and (force or m.lease_expired)
        if takes_over and not force and m.lost():
            assert out == "failed"
            m.state = "failed"
            return multiple()
        if m.state == "queued" or takes_over:
            assert not isinstance(out, str), out
            m.attempts += 1
            assert out.attempt == m.attempts
            m.state, m.progress, m.lease_expired, m.group = "running", 0.0, False, 0
            return out
        assert out == (m.state if m.state in TERMINAL_STATES else "running")
        assert self._snapshot(job_id) == before
        return multiple()

    @rule(handle=handles, p=st.floats(0.0, 1.0))
    def progress(self, handle, p):
        m = self.model[handle.job_id]
        before = self._snapshot(handle.job_id)
        code = self.store.progress_many([(handle, p)])[handle.job_id]
        if m.state == "canceled":
            assert code == CANCELED
        elif self._current(handle):
            assert code == HELD
            m.progress, m.lease_expired = max(m.progress, p), False
        else:
            assert code == STALE and self._snapshot(handle.job_id) == before

    @rule(handle=handles, size=st.sampled_from([1, 2, 4]))
    def render(self, handle, size):
        m = self.model[handle.job_id]
        code = self.store.mark_rendering([handle] * size)[handle.job_id]
        if m.state == "canceled":
            assert code == CANCELED
        elif self._current(handle):
            assert code == HELD
            m.group, m.lease_expired = size, False
        else:
            assert code == STALE

    @rule(handle=handles, expire=st.booleans(), rendered=st.booleans())
    def renew(self, handle, expire, rendered):
        m = self.model[handle.job_id]
        code = (self.expiring if expire else self.store).renew_leases([handle], rendered=rendered)[handle.job_id]
        if m.state == "canceled":
            assert code == CANCELED
        elif self._current(handle):
            assert code == HELD
            m.lease_expired = expire
            m.group = 0 if rendered else m.group
        else:
            assert code == STALE

    @rule(handle=handles)
    def succeed(self, handle):
        m = self.model[handle.job_id]
        before = self._snapshot(handle.job_id)
        result = JobResult(key=f"k/{handle.job_id}", width=64, height=64, seed=1, content_type="image/png", bytes=1)
        ok = self.store.succeed(handle, result)
        assert ok == self._current(handle)
        if ok:
            m.state, m.progress = "succeeded", 1.0
        else:
            assert self._snapshot(handle.job_id) == before

    @rule(handle=handles, retry=st.booleans())
    def fail(self, handle, retry):
        m = self.model[handle.job_id]
        before = self._snapshot(handle.job_id)
        out = self.store.fail(handle, JobError(type="Boom", message="injected"), retry=retry)
        if not self._current(handle):
            assert out is None and self._snapshot(handle.job_id) == before
        elif retry and m.used < MAX_ATTEMPTS:
            assert out == "queued"
            m.state, m.progress = "queued", 0.0
        else:
            assert out == "failed"
            m.state = "failed"

    @rule(i=st.integers(0, JOBS - 1))
    def cancel(self, i):
        m = self.model[self.ids[i]]
        before = self._snapshot(self.ids[i])
        ok = self.store.cancel(self.ids[i])
        assert ok == (m.state not in TERMINAL_STATES)
        if ok:
            m.state = "canceled"
        else:
            assert self._snapshot(self.ids[i]) == before

    @rule(handle=handles)
    def release(self, handle):
        m = self.model[handle.job_id]
        released = self.store.release([handle])
        if self._current(handle):
            assert released == [(handle.job_id, "sm-pool")]
            m.state, m.progress, m.attempt_base = "queued", 0.0, m.attempt_base + 1
        else:
            assert released == []

    @rule(i=st.integers(0, JOBS - 1))
    def reap(self, i):
        job_id = self.ids[i]
        m = self.model[job_id]
        moved = self.store.requeue_expired([job_id])
        if m.state == "running" and m.lease_expired:
            if m.lost():
                assert moved == {job_id: ("failed", "")}
                m.state = "failed"
            else:
                assert moved == {job_id: ("queued", "sm-pool")}
                m.state, m.progress = "queued", 0.0
        else:
            assert moved == {}

    @rule(i=st.integers(0, JOBS - 1))
    def retry_dead_letter(self, i):
        job_id = self.ids[i]
        m = self.model[job_id]
        if m.state == "failed" and m.kills and m.kill_retries >= MAX_KILL_RETRIES:
            with pytest.raises(RetryRefused, match="killed its worker"):
                self.store.retry(job_id)
            return
        pool = self.store.retry(job_id)
        if m.state == "failed":
            assert pool == "sm-pool"
            m.state, m.progress, m.attempt_base, m.losses = "queued", 0.0, m.attempts, 0
            m.kill_retries += 1 if m.kills else 0
        else:
            assert pool is None

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def store_agrees_with_the_model(self):
        for job_id in self.ids:
            h = self.client.hgetall(keys.job(job_id))
            m = self.model[job_id]
            assert h["state"] == m.state
            assert int(h["attempts"]) == m.attempts
            assert int(h.get("attempt_base", 0)) == m.attempt_base and int(h.get("kills", 0)) == m.kills
            if m.state != "failed":  # a failed job keeps the progress it had
                assert float(h["progress"]) == pytest.approx(m.progress)
            assert (h.get("result") is not None) == (m.state == "succeeded")

    @invariant()
    def counters_add_up(self):
        counts = self.client.hgetall(keys.batch_counts(self.batch_id))
        states = [self.client.hget(keys.job(j), "state") for j in self.ids]
        for state in JOB_STATES:
            assert int(counts.get(state, 0)) == states.count(state), (state, counts, states)
        assert sum(int(counts.get(s, 0)) for s in JOB_STATES) == JOBS
        expected_done = sum(1.0 if s in TERMINAL_STATES else float(self.client.hget(keys.job(j), "progress"))
                            for j, s in zip(self.ids, states))
        assert float(counts["done"]) == pytest.approx(expected_done, abs=1e-6)

    @invariant()
    def indexes_follow_states(self):
        for job_id in self.ids:
            state = self.model[job_id].state
            assert (self.client.zscore(keys.leases(keys.shard(job_id)), job_id) is not None) == (state == "running")
            assert (self.client.zscore(keys.pending(keys.shard(job_id)), job_id) is not None) == (state == "queued")
            assert (self.client.zscore(keys.dead(keys.shard(job_id)), job_id) is not None) == (state == "failed")


def test_store_state_machine(redis_server):
    client = redis_server.client(db=DB)
    client.flushdb()
    StoreMachine.client = client
    run_state_machine_as_test(StoreMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
