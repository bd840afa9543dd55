"""The public types of the farm's workers and queues (ARCHITECTURE.md, "Public contract"):
:class:`WorkerInfo` (``GET /v1/workers``) and :class:`QueueDepth` (``GET /v1/queues``), re-exported
by :mod:`infra.schemas` with the request and job types.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorkerInfo(BaseModel):
    """One live worker, as its heartbeat describes it (``GET /v1/workers``). Times are epoch
    seconds; ``device`` is the device profile and ``recipe`` the optimizations in force, with a
    report of what was applied. Fields a newer worker adds are passed through."""

    model_config = ConfigDict(extra="allow")

    name: str
    model: str | None = None
    pool: str | None = None
    queue: str | None = None
    device: dict | None = None
    recipe: dict | None = None
    batch_size: int | None = None
    pid: int | None = None
    host: str | None = None
    started_at: float | None = None
    last_heartbeat: float
    heartbeat_age_s: float
    images_done: int | None = None
    jobs_failed: int | None = None
    current_jobs: list[str] = Field(default_factory=list)
    reserved_jobs: list[str] = Field(default_factory=list)
    healthy: bool = True
    breaker: dict | None = None
    images_per_s: float | None = Field(None, description="Images finished per second over the last few minutes.")
    state: str | None = Field(None, description="loading (the pipeline), sizing (measuring the batch size, or "
                              "reading it from the compile cache), warming (compiling and rendering every batch "
                              "bucket × served size), or ready (takes jobs). Only ready takes jobs.")
    warmup: dict | None = Field(None, description="The current state's progress {done, total (renders), eta_s "
                                "(seconds; from the renders so far, else the state's seconds at the pool's last "
                                "start)}, and once ready the warm-up report (seconds, renders, compiles, per-shape "
                                "seconds, plan) and ready_at.")
    startup: dict | None = Field(None, description="The start-up: phases (seconds each finished state took), "
                                 "estimates (seconds each state took at the pool's last start), state_started_at "
                                 "(epoch seconds) and the sizing report (batch_size, record: hit, miss, corrupt, "
                                 "mismatch, error, none or skipped; width, height, steps, bytes per path).")
    buckets: list[int] = Field(default_factory=list, description="The batch buckets it compiled (images).")
    recompiles: int | None = Field(None, description="torch.compile compilations since the warm-up (0 expected).")
    compiled_renders: int | None = Field(None, description="Pipeline calls since the warm-up that ran compiled code "
                                         "alone (TorchDynamo graphs, AOTInductor packages, OpenVINO models).")
    eager_renders: int | None = Field(None, description="Pipeline calls since the warm-up in which a compiled module "
                                      "ran eagerly: seen to miss its graphs (a shape the warm-up did not compile).")
    compile_cache: dict | None = Field(None, description="The shared compile cache at start-up: key, outcome (hit, "
                                       "miss, corrupt, mismatch, error), reason, bytes, seconds, saved, and "
                                       "Inductor's FX graph cache hits and misses after the warm-up (counters).")


class QueueDepth(BaseModel):
    """One pool's queue depths in jobs (``GET /v1/queues``). ``outstanding`` = queued + reserved +
    running is the autoscaling signal (KEDA's metrics-api scaler reads it); ``oldest_wait_s`` is
    how long the longest-waiting unstarted job has waited, seconds."""

    pool: str
    queued: int = Field(description="Waiting for dispatch (wait lanes) or in the broker queue.")
    reserved: int = Field(description="Prefetched by workers, not started.")
    running: int = Field(description="Rendering now.")
    outstanding: int = Field(description="queued + reserved + running: what an autoscaler must provide for.")
    workers: int = Field(description="Live workers of the pool.")
    oldest_wait_s: float = Field(description="Seconds the longest-waiting unstarted job has waited.")
