"""The KEDA + HPA replay: one pool's replicas second by second under an arrival of jobs.

Data flow: an arrival and a :class:`PoolModel` (from :mod:`infra.capacity.sources` or flags) →
**a second-by-second replay** (:func:`simulate`) → a :class:`PlanResult`: replicas over time,
time to drain, GPU-hours (printed by ``renderfarm plan``, :mod:`infra.capacity.cli`).

The model follows what the chart deploys (``deploy/helm/renderfarm/templates/scaledobjects.yaml``):

- The signal is the pool's outstanding jobs (queued + reserved + running, :mod:`infra.broker.depths`).
- **KEDA** polls every ``polling_interval_s``. At zero replicas it activates the pool once
  outstanding > ``activation`` (0 → 1 replica); it scales back to zero after ``cooldown_s`` with
  outstanding ≤ ``activation``. Between 1 and max, the HPA decides.
- **HPA** (every ``hpa_sync_s``, 15 s in Kubernetes), metricType ``AverageValue``:
  ``desired = ceil(current × (outstanding / current) / target) = ceil(outstanding / target)``,
  skipped within a 10 % tolerance, clamped to [max(min, 1), max]; then the behavior:
  stabilization windows (scale up to the lowest, down to the highest recommendation of the
  window) and rate policies (``Pods``/``Percent`` per ``periodSeconds``, ``selectPolicy``).
- A new replica serves after ``cold_start_s`` (node, image pull, model load, warm-up) at
  ``images_per_s``; work is fluid (no batch granularity). A replica costs ``gpus_per_replica``
  GPUs from creation to removal, cold start included.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class Policy:
    """One HPA scaling policy: change by ``value`` pods (``Pods``) or percent (``Percent``) per ``period_s``."""

    type: str
    value: int
    period_s: int


@dataclass(frozen=True)
class Behavior:
    """HPA ``behavior`` for one direction: stabilization window (s), policies and ``select`` (Max/Min/Disabled)."""

    window_s: int
    policies: tuple[Policy, ...]
    select: str = "Max"


# Kubernetes' own defaults when a ScaledObject says nothing.
K8S_SCALE_UP = Behavior(0, (Policy("Pods", 4, 15), Policy("Percent", 100, 15)))
K8S_SCALE_DOWN = Behavior(300, (Policy("Percent", 100, 15),))


@dataclass(frozen=True)
class PoolModel:
    """One pool's throughput and autoscaling settings. Times in seconds."""

    images_per_s: float                 # per ready replica
    target: float = 64                  # outstanding jobs per replica (AverageValue)
    min_replicas: int = 0
    max_replicas: int = 4
    activation: float = 0               # activate from zero when outstanding > this
    polling_interval_s: int = 15
    cooldown_s: int = 600
    cold_start_s: float = 90
    gpus_per_replica: float = 1.0
    hpa_sync_s: int = 15
    scale_up: Behavior = field(default_factory=lambda: Behavior(0, (Policy("Pods", 4, 60), Policy("Percent", 100, 60))))
    scale_down: Behavior = field(default_factory=lambda: Behavior(300, (Policy("Percent", 50, 60),)))


@dataclass
class PlanResult:
    """What one replay found. ``timeline`` rows: ``t`` (s from the first arrival), ``replicas``
    (desired), ``ready``, ``outstanding`` (jobs) and ``images_per_s`` (served)."""

    timeline: list[dict[str, float]]
    drain_s: float | None               # first arrival → nothing outstanding after the last one
    gpu_hours: float                    # replica-hours × GPUs per replica
    replica_hours: float                # replicas alive (starting, busy or idle), hours
    mean_latency_s: float               # arrival → done, averaged over jobs (Little's law)
    peak_replicas: int
    first_ready_s: float | None         # first arrival → first replica serving
    zero_at_s: float | None             # first arrival → back at zero replicas (None: never)
    jobs: int
    end_s: float


def _policy_limit(behavior: Behavior, history: deque, now: float, current: int, up: bool) -> int:
    """Most (``up``) or fewest replicas the policies allow now, from the replica count at each
    policy's period start (current minus the changes made within the period)."""
    if behavior.select == "Disabled":
        return current
    limits = []
    for pol in behavior.policies:
        changed = sum(d for t, d in history if t > now - pol.period_s)
        start = current - changed
        if up:
            limits.append(start + pol.value if pol.type == "Pods" else math.ceil(start * (1 + pol.value / 100)))
        else:
            limits.append(start - pol.value if pol.type == "Pods" else math.floor(start * (1 - pol.value / 100)))
    if not limits:
        return current
    pick = max if (behavior.select == "Max") == up else min
    return pick(limits)


class _Replay:
    """One pool during a replay: replicas, the ready-at time of each pod, the HPA's recent
    recommendations and changes, and the running totals. One call of :meth:`step` is one second."""

    def __init__(self, pool: PoolModel):
        self.pool = pool
        self.hpa_min, self.hpa_max = max(pool.min_replicas, 1), pool.max_replicas
        self.outstanding = 0.0
        self.replicas = pool.min_replicas
        self.pods: list[float] = [-pool.cold_start_s] * self.replicas   # ready-at times; min replicas start warm
        self.last_active = 0.0
        self.recs: deque[tuple[float, int]] = deque()                   # (t, HPA recommendation)
        self.changes: deque[tuple[float, int]] = deque()                # (t, replica delta) by the HPA
        self.gpu_s = self.replica_s = self.job_s = 0.0
        self.first_ready: float | None = None
        self.peak = self.replicas
        self.timeline: list[dict[str, float]] = []

    def set_replicas(self, n: int, t: float) -> None:
        """Scale to ``n`` replicas at ``t``: new pods are ready after the cold start; removed
        ones go not-ready first, then newest first (the ReplicaSet's order)."""
        if n > self.replicas:
            self.pods.extend([t + self.pool.cold_start_s] * (n - self.replicas))
        elif n < self.replicas:
            self.pods.sort()
            del self.pods[n:]
        self.replicas = n
        self.peak = max(self.peak, n)

    def keda(self, t: float, metric: int) -> None:
        """KEDA at its polling interval: activation from zero, and deactivation after the cooldown."""
        pool = self.pool
        if metric > pool.activation:
            self.last_active = t
        if int(t) % pool.polling_interval_s != 0:
            return
        if self.replicas == 0 and metric > pool.activation:
            self.set_replicas(self.hpa_min, t)
            self.changes.append((t, self.replicas))
        elif pool.min_replicas == 0 and self.replicas > 0 and metric <= pool.activation \
                and t - self.last_active >= pool.cooldown_s:
            self.set_replicas(0, t)
            self.recs.clear()
            self.changes.clear()

    def hpa(self, t: float, metric: int) -> None:
        """The HPA at its sync period, only while KEDA has the pool active (≥ 1 replica):
        recommendation, stabilization windows, rate policies, clamp to [max(min, 1), max]."""
        pool, replicas = self.pool, self.replicas
        if replicas == 0 or int(t) % pool.hpa_sync_s != 0:
            return
        ratio = metric / (pool.target * replicas)
        rec = replicas if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(metric / pool.target)
        self.recs.append((t, min(max(rec, self.hpa_min), self.hpa_max)))
        keep = max(pool.scale_up.window_s, pool.scale_down.window_s)
        while self.recs and self.recs[0][0] < t - keep:
            self.recs.popleft()
        up_rec = min(r for s, r in self.recs if s >= t - pool.scale_up.window_s)
        down_rec = max(r for s, r in self.recs if s >= t - pool.scale_down.window_s)
        new = replicas
        if up_rec > replicas:
            new = min(up_rec, _policy_limit(pool.scale_up, self.changes, t, replicas, up=True))
        elif down_rec < replicas:
            new = max(down_rec, _policy_limit(pool.scale_down, self.changes, t, replicas, up=False))
        new = min(max(new, self.hpa_min), self.hpa_max)
        if new != replicas:
            self.changes.append((t, new - replicas))
            self.set_replicas(new, t)
        while self.changes and self.changes[0][0] < t - 3600:
            self.changes.popleft()

    def serve(self, t: float) -> None:
        """The ready replicas serve one second of work; the totals and the timeline advance."""
        ready = sum(1 for r in self.pods if r <= t)
        if ready and self.first_ready is None:
            self.first_ready = t
        served = min(self.outstanding, ready * self.pool.images_per_s)
        self.outstanding -= served
        if self.outstanding < 1e-9:
            self.outstanding = 0.0
        self.gpu_s += self.replicas * self.pool.gpus_per_replica
        self.replica_s += self.replicas
        self.job_s += self.outstanding + served / 2    # jobs in the system during this second
        row = {"t": t, "replicas": self.replicas, "ready": ready, "outstanding": math.ceil(self.outstanding),
               "images_per_s": round(served, 3)}
        last = self.timeline[-1] if self.timeline else None
        if last is None or (row["replicas"], row["ready"]) != (last["replicas"], last["ready"]) \
                or (self.outstanding == 0) != (last["outstanding"] == 0):
            self.timeline.append(row)

    def step(self, t: float) -> None:
        """One second: KEDA, then the HPA, then the work served."""
        metric = math.ceil(self.outstanding)
        self.keda(t, metric)
        self.hpa(t, metric)
        self.serve(t)


def simulate(arrivals: list[tuple[float, int]], pool: PoolModel, *, horizon_s: float | None = None) -> PlanResult:
    """Replay ``arrivals`` (``(seconds from the start, jobs)``) against ``pool``, one-second steps.

    Runs until every job is done and the pool is back at its minimum, or ``horizon_s`` seconds
    (default: 48 h past the last arrival).

    Raises:
        ValueError: no arrival with jobs.
    """
    arrivals = sorted((float(t), int(n)) for t, n in arrivals if n > 0)
    if not arrivals:
        raise ValueError("no arrivals")
    t0 = arrivals[0][0]
    pending = deque((t - t0, n) for t, n in arrivals)
    jobs = sum(n for _, n in arrivals)
    horizon = horizon_s if horizon_s is not None else pending[-1][0] + 48 * 3600
    replay = _Replay(pool)
    drain_s = zero_at = None
    t = 0.0
    while t <= horizon:
        while pending and pending[0][0] <= t:
            replay.outstanding += pending.popleft()[1]
        replay.step(t)
        if replay.outstanding == 0 and not pending and drain_s is None:
            drain_s = t + 1
        if drain_s is not None and replay.replicas == 0 and zero_at is None:
            zero_at = t
        if drain_s is not None and replay.replicas <= pool.min_replicas:
            break
        t += 1
    return PlanResult(timeline=replay.timeline, drain_s=drain_s, gpu_hours=replay.gpu_s / 3600,
                      replica_hours=replay.replica_s / 3600, mean_latency_s=replay.job_s / jobs,
                      peak_replicas=replay.peak, first_ready_s=replay.first_ready, zero_at_s=zero_at,
                      jobs=jobs, end_s=t)
