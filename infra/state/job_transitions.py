"""A worker's transitions of its jobs: start, progress and leases, success, failure, release;
and cancellation. Pipelined over a group: one script call per shard of the jobs.

Place in the data flow: the worker (``worker.runner``) → **here** → the job records
(:mod:`infra.state.job_records`) through the Lua scripts of :mod:`infra.state.scripts` (one job)
and :mod:`infra.state.group_scripts` (a group, each job fenced on its own) → the status API
reads the result. Part of :class:`infra.state.job_store.JobStore`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.commands.core import Script

from infra import keys
from infra.schemas import JobError, JobResult, RenderRequest
from infra.state.job_reads import PUBLIC_TENANT
from infra.state.job_records import MAX_LOSSES, JobRecords, StartedJob

#: Answers of :meth:`JobTransitions.progress_many` / :meth:`JobTransitions.renew_leases`, per job.
STALE, HELD, CANCELED = 0, 1, 2


class JobTransitions(JobRecords):
    """A worker's writes to its jobs, each fenced by the attempt's ``attempt:epoch`` token
    (:class:`~infra.state.job_records.StartedJob`); a stale attempt's write changes nothing."""

    def start_many(self, job_ids: Sequence[str], worker: str, *, force: bool = False) -> dict[str, StartedJob | str]:
        """Move each job to ``running`` for ``worker`` with a fresh lease; two round trips (one
        script call per shard of the jobs, :mod:`infra.state.group_scripts`), and a third for
        running jobs whose lease expired (or all running ones, forced), which the one-job start
        script takes over, accounting the lost attempt first.

        A repeated id is started once. Returns, per job id, a :class:`StartedJob`, or the reason
        it must not run: ``missing``, a terminal state, or ``running`` (another attempt holds a
        live lease). ``force`` takes over a running job whatever its lease (operators only).
        """
        job_ids = list(dict.fromkeys(job_ids))
        owners = dict(zip(job_ids, self._owners(job_ids)))
        answers = self._grouped(self._start_group, [(j, *owners[j]) for j in job_ids],
                                [worker, repr(self.lease_s), "1" if force else "0"], lambda job_id: [job_id])
        single = [j for j in job_ids if int(answers[j][0]) < 0]  # expired or forced: the one-job script
        if single:  # accounts the lost attempt first
            pipe = self.r.pipeline(transaction=False)
            for job_id in single:
                self._run(self._start, self._keys(job_id, *owners[job_id]),
                          [job_id, worker, repr(self.lease_s), "1" if force else "0", self.max_attempts, MAX_LOSSES],
                          pipe)
            answers.update(zip(single, pipe.execute()))
        out: dict[str, StartedJob | str] = {}
        for job_id in job_ids:
            (attempt, payload, *rest), (batch_id, tenant) = answers[job_id], owners[job_id]
            if int(attempt) == 0:
                out[job_id] = payload
            else:
                out[job_id] = StartedJob(job_id, batch_id, int(attempt), RenderRequest.model_validate_json(payload),
                                         tenant, rest[0] if rest else "", int(rest[1]) if len(rest) > 1 else 0)
        return out

    def _grouped(self, script: Script, jobs: Sequence[tuple[str, str, str | None]], head: list,
                 per_job: Callable[[str], list]) -> dict[str, Any]:
        """Run a per-group script (:mod:`infra.state.group_scripts`) once per shard of ``jobs``
        (``(job_id, batch_id, tenant)``, one slot each on Redis Cluster), all in one round trip:
        ``head`` then ``per_job(job_id)`` as arguments. Returns each job's answer by id."""
        groups = self._shard_groups(jobs)
        pipe = self.r.pipeline(transaction=False)
        for group, names in groups:
            self._run(script, names, [*head, *(arg for j, _, _ in group for arg in per_job(j))], pipe)
        return {j: answer for (group, _), answers in zip(groups, pipe.execute() if groups else [])
                for (j, _, _), answer in zip(group, answers)}

    def _shard_groups(self, jobs: Sequence[tuple[str, str, str | None]]) -> list[tuple[list, list[str]]]:
        """``jobs`` (``(job_id, batch_id, tenant)``) by the shard of their ids, each group with the
        keys of its script call (nine per job; one slot on Redis Cluster)."""
        groups: dict[str, list[tuple[str, str, str | None]]] = {}
        for job in jobs:
            groups.setdefault(keys.shard(job[0]), []).append(job)
        return [(group, [name for j, b, t in group for name in self._keys(j, b, t)]) for group in groups.values()]

    def progress_many(self, updates: Iterable[tuple[StartedJob, float]]) -> dict[str, int]:
        """Record progress 0…1 for running jobs and renew their leases, in one round trip.

        Returns, per job id, :data:`HELD` (this attempt still holds the job), :data:`CANCELED`
        (canceled meanwhile: stop working on it) or :data:`STALE` (another attempt or a
        terminal state owns it: discard this attempt's work).
        """
        return self._touch((job, repr(progress), "") for job, progress in updates)

    def renew_leases(self, jobs: Iterable[StartedJob], *, rendered: bool = False) -> dict[str, int]:
        """Extend the leases of running jobs by ``lease_s`` from now, in one round trip; answers
        as :meth:`progress_many` does, so it also tells whether each job is still held. With
        ``rendered``, also record that their render is over (see :meth:`mark_rendering`)."""
        return self._touch((job, "", "0" if rendered else "") for job in jobs)

    def mark_rendering(self, jobs: Sequence[StartedJob], rendered: Sequence[StartedJob] = ()) -> dict[str, int]:
        """Record that this attempt now renders ``jobs`` as one group (their ``group_n``, read by
        the reaper should the worker be lost: bisection across attempts, :mod:`infra.state.scripts`)
        and that the render of ``rendered`` (the group before, still being stored) is over, so
        that a crash from here on is not laid on them; renews all their leases, in one round
        trip, and answers as :meth:`renew_leases`."""
        group = str(len(jobs))
        return self._touch([*((job, "", "0") for job in rendered), *((job, "", group) for job in jobs)])

    def _touch(self, updates: Iterable[tuple[StartedJob, str, str]]) -> dict[str, int]:
        updates = list(updates)  # a job twice: its last update wins, as one write after another would
        args = {job.job_id: [job.job_id, job.token, progress, group] for job, progress, group in updates}
        jobs = {job.job_id: job for job, _, _ in updates}
        return {j: int(code) for j, code in self._grouped(
            self._touch_group, [(j, job.batch_id, job.tenant or PUBLIC_TENANT) for j, job in jobs.items()],
            [repr(self.lease_s)], args.__getitem__).items()}

    def succeed(self, job: StartedJob, result: JobResult) -> bool:
        """``running`` → ``succeeded`` for this attempt. False when the attempt is stale."""
        return bool(self._finish_one(job.job_id, job.token, "succeeded", "result", result.model_dump_json(),
                                     batch_id=job.batch_id, tenant=job.tenant))

    def succeed_many(self, results: Sequence[tuple[StartedJob, JobResult]]) -> dict[str, bool]:
        """:meth:`succeed` for a group's jobs in one round trip (one script call per shard of the
        jobs, :mod:`infra.state.group_scripts`, in which each job is fenced on its own by its
        attempt's ``attempt:epoch`` token; jobs
        started by :meth:`start_many` carry their tenant, so no lookup precedes it). Returns, per
        job id, False for a stale attempt."""
        payloads = {job.job_id: [job.job_id, job.token, result.model_dump_json()] for job, result in results}
        answers = self._grouped(self._succeed_group, [(job.job_id, job.batch_id, job.tenant) for job, _ in results],
                                [], payloads.__getitem__)
        return {job.job_id: bool(int(answers[job.job_id])) for job, _ in results}

    def fail(self, job: StartedJob, error: JobError, *, retry: bool = False) -> str | None:
        """``running`` → ``failed`` for this attempt, listed in the dead-letter set.

        With ``retry`` (a transient error: storage or broker away, out of memory) and attempts
        left, the job goes back to ``queued`` instead, its error kept as ``last_error``; the
        caller republishes it. Returns ``"failed"``, ``"queued"``, or None when the attempt is stale.
        """
        code = self._finish_one(job.job_id, job.token, "failed", "error", error.model_dump_json(),
                                batch_id=job.batch_id, tenant=job.tenant, retry=retry)
        return {1: "failed", 2: "queued"}.get(code)

    def cancel(self, job_id: str) -> bool:
        """Any non-terminal state → ``canceled``. False when the job is unknown or already ended.

        A running job's worker learns it at its next progress write and drops the job."""
        return bool(self._finish_one(job_id, "*", "canceled", "", ""))

    def _finish_one(self, job_id: str, attempt: str, state: str, field: str, payload: str,
                    batch_id: str | None = None, tenant: str | None = None, retry: bool = False) -> int:
        return int(self._finish(keys=self._keys(job_id, batch_id, tenant),
                                args=[job_id, attempt, state, field, payload, "1" if retry else "0",
                                      self.max_attempts]))

    def release(self, jobs: Iterable[StartedJob]) -> list[tuple[str, str]]:
        """Give running jobs back (worker shutting down): this attempt → ``queued``, without
        spending the attempt budget. Returns ``(job_id, pool)`` of those released, to republish."""
        jobs = list(jobs)
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            self._run(self._release, self._keys(job.job_id, job.batch_id, job.tenant),
                      [job.job_id, job.token], pipe)
        return [(job.job_id, pool) for job, (code, pool) in zip(jobs, pipe.execute() if jobs else []) if int(code)]
