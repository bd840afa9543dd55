"""Configuration for every process of the farm, read once from ``RENDERFARM_*`` variables.

Producer, worker and API all read the same :class:`Settings`; nothing else parses the
environment. The settings reference of the docs site (``docs/reference/settings.md``) is
generated from this model's fields.

Sources, first wins: arguments, then the environment, then the **client settings file** that
``renderfarm up`` writes (``.renderfarm/env``, dotenv syntax, found in the working directory or
the nearest parent that has one), so that ``renderfarm submit`` in another shell finds the local
stack without ``export`` lines. ``RENDERFARM_ENV_FILE`` names another file, or none when set to
the empty string (the test suite does so: a developer's file never reaches a test).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from infra.controls import ControlSpec
from infra.pools import OFFLINE_UPSCALERS, LoraSpec, PoolSpec, check_brokers, check_unique

#: The variable naming the client settings file ("" = none); read before any setting.
ENV_FILE_VAR = "RENDERFARM_ENV_FILE"
#: Where ``renderfarm up`` writes the client settings, relative to its working directory.
DEFAULT_ENV_FILE = Path(".renderfarm") / "env"


def env_file_path(*, for_writing: bool = False) -> Path | None:
    """The client settings file: ``$RENDERFARM_ENV_FILE`` when set (None when it is empty), else
    ``.renderfarm/env`` in the working directory or, for reading, the nearest parent directory
    that has one (None when none has). ``for_writing`` gives the path ``renderfarm up`` writes:
    ``./.renderfarm/env`` whether it exists or not."""
    configured = os.environ.get(ENV_FILE_VAR)
    if configured is not None:
        return Path(configured).expanduser() if configured.strip() else None
    try:
        cwd = Path.cwd()
    except OSError:  # the working directory was removed
        return None
    if for_writing:
        return cwd / DEFAULT_ENV_FILE
    return next((d / DEFAULT_ENV_FILE for d in (cwd, *cwd.parents) if (d / DEFAULT_ENV_FILE).is_file()), None)


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "renderfarm"


class Settings(BaseSettings):
    """All tunables of the farm. Field ``x`` is read from ``RENDERFARM_X``.

    The S3 credentials are boto3's standard ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
    (and the rest of boto3's credential chain). They are read here too only so that the ones in
    the client settings file reach boto3 (:meth:`s3_credentials`); ``RENDERFARM_*`` clients need
    none (images come through presigned URLs).
    """

    model_config = SettingsConfigDict(env_prefix="RENDERFARM_", extra="ignore", populate_by_name=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The Celery broker, and the job-state store "
                           "unless RENDERFARM_STATE_REDIS_URL names another. sentinel://[:password@]host:26379"
                           "[,host:26379…]/master_name[/db] (sentinels:// for TLS): a Sentinel group's primary, "
                           "followed through failovers.")
    state_redis_url: str = Field("", description="The job-state store's Redis; empty: RENDERFARM_REDIS_URL. "
                                 "redis+cluster:// (rediss+cluster://) and a seed node's host:port: Redis "
                                 "Cluster (the broker then stays on a plain Redis at RENDERFARM_REDIS_URL).")
    s3_endpoint_url: str = Field("", description="S3 endpoint; empty means AWS.")
    s3_bucket: str = Field("renders", description="Bucket that receives rendered images.")
    s3_region: str = Field("us-east-1", description="Region used to sign S3 requests.")
    presign_expires_s: int = Field(3600, ge=1, le=7 * 24 * 3600, description="Presigned GET lifetime, seconds.")
    api_url: str = Field("http://127.0.0.1:8000", description="Status API base URL, for clients.")
    api_key: str = Field("", description="The client's API key (sent as X-API-Key).")
    data_dir: Path | None = Field(None, description="`renderfarm up` keeps its Redis AOF (redis/) and SeaweedFS "
                                  "data (seaweedfs/) here, together, across runs; default <cache_dir>/data.")
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Offline-built models live here.")
    openvino_ir_dir: Path | None = Field(
        None, description="A local directory of converted OpenVINO models (IR), for loads that get no shared "
        "store: the benches, scripts, the tests. Weights already converted there are read from their IR "
        "instead of traced again (sd15-arch's UNet: a 23 s trace on a 2-core AVX2 EPYC). Unset: such a load "
        "converts every time. Workers share converted models through the bucket (compile-cache/) instead.")
    default_model: str = Field("tiny", description="Model used when a request names none.")
    batch_size: int = Field(0, ge=0, le=256, description="Worker batch size; 0 = the device recipe's.")
    null_render_ms_per_image: float = Field(0.0, ge=0, le=600_000, description="The null renderer's simulated "
                                            "GPU: milliseconds slept per image of a batch (GIL released); 0 = none.")
    recipe: str = Field("exact", description="Worker recipe: exact, fast (allows approximations), baseline or a name.")
    recipe_overrides: str = Field("", description="JSON object overriding single recipe knobs.")
    worker_overlap: bool = Field(True, description="The worker renders the next group while the last one is "
                                 "encoded, uploaded and recorded (worker/runner.py run_overlapped); off: in turn.")
    flush_interval_s: float = Field(0.25, gt=0, le=0.25, description="celery-batches flush interval, seconds.")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="Worker heartbeat period, seconds.")
    heartbeat_ttl_s: float = Field(20.0, gt=0, description="A worker unseen this long is gone, seconds.")
    job_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="Job records expire this long after the job ended "
                                                          "(never while queued or running), seconds.")
    durable_ack: str = Field("off", pattern="^(off|local|replicas)$", description="Before a 202, wait until "
                             "Redis has the jobs on disk: off, local (WAITAOF 1 0 on Redis >= 7.2, else a "
                             "bounded wait for the everysec fsync) or replicas (and one replica).")
    durable_ack_timeout_ms: int = Field(5000, ge=1, description="Most milliseconds a durable-ack wait may take; "
                                        "past it the API answers 503 (the jobs exist; retry with the same key).")
    max_batch_jobs: int = Field(10_000, ge=1, le=10_000, description="Most jobs one batch submission may carry.")
    # pools and priorities (infra/pools.py, infra/broker/dispatch.py)
    pools: Annotated[list[PoolSpec], NoDecode] = Field(
        default_factory=list, description="Declared worker pools, a JSON list of {name, model, device_class, "
                                          "max_pixels, max_batch, queue}; empty = one pool per model.")
    brokers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="Broker shards, a JSON object {name: Redis or sentinel:// URL}: a pool "
        "naming one (its broker field) has its Celery queue there instead of on RENDERFARM_REDIS_URL.")
    upscalers: str = Field(",".join(OFFLINE_UPSCALERS), description="Comma-separated upscaler specs a request may "
                           "name while no pool is declared (a declared pool lists its own); the default is the "
                           "offline builds, so no request makes a worker download a file it names.")
    loras: Annotated[list[LoraSpec], NoDecode] = Field(
        default_factory=list, description="Adapters a request may name while no pool is declared, a JSON list of "
                                          "{name, source, weight_name}; a declared pool lists its own (loras).")
    controls: Annotated[list[ControlSpec], NoDecode] = Field(
        default_factory=list, description="ControlNets a request's control units may name while no pool is "
                                          "declared, a JSON list of {name, source} (source: hub id, local path, "
                                          "s3://<key> or tiny-controlnet…); a declared pool lists its own (controls).")
    input_max_bytes: int = Field(8 * 2**20, ge=1024, description="Largest input image (upload or fetched URL), "
                                                                  "bytes; larger → 413.")
    input_max_pixels: int = Field(4096 * 4096, ge=64 * 64, description="Most decoded pixels of an input image (a "
                                  "decompression-bomb guard next to Pillow's MAX_IMAGE_PIXELS); more → 422.")
    input_allow_private: bool = Field(False, description="Let the API fetch input-image URLs (init_image, "
                                      "mask_image) from hosts on loopback/private/link-local addresses (SSRF guard "
                                      "off for inputs). Off: such a URL is a 422. The fetch still verifies TLS "
                                      "against the CA bundle (SSL_CERT_FILE names another).")
    dispatch_interval_s: float = Field(0.2, gt=0, le=10, description="Seconds between two dispatcher passes "
                                                                      "(a submission wakes it at once).")
    dispatch_depth: float = Field(2.0, gt=0, le=100, description="A pool's Celery queue is kept at most this many "
                                                                  "× its live workers' total batch size deep.")
    priority_aging_s: float = Field(300.0, ge=0, description="Seconds of waiting that raise a job one priority level "
                                                              "(low → normal → high); 0 = no aging.")
    # recovery and health (infra/broker/reaper.py, worker/runner.py, worker/breaker.py)
    lease_s: float = Field(20.0, gt=0, description="A running job's lease without renewal, seconds; the worker "
                                                   "renews it every heartbeat and progress write.")
    max_attempts: int = Field(3, ge=1, le=100, description="Attempts (lost worker, transient error) before a job "
                                                           "fails into the dead-letter set.")
    reaper_enabled: bool = Field(True, description="Run the reaper inside the status API process.")
    reaper_interval_s: float = Field(5.0, gt=0, description="Seconds between two reaper sweeps.")
    republish_after_s: float = Field(
        30.0, gt=0, description="A queued job found in no queue and held by no live "
        "worker this long after its last publish is republished, seconds.")
    job_timeout_s: float = Field(600.0, gt=0, description="Longest render of one job (its group), seconds; "
                                                          "checked between denoising steps.")
    render_stall_s: float = Field(300.0, ge=0, description="A render without a denoising step for this long, "
                                  "seconds, is wedged: the worker gives its jobs up and exits 70 for its supervisor "
                                  "to restart it (worker/watchdog.py); 0 = never.")
    upload_retry_s: float = Field(60.0, ge=0, description="How long an upload rides out a storage outage, seconds.")
    upload_threads: int = Field(0, ge=0, le=256, description="Threads that encode and upload a group's images at "
                                "once; 0 = sized to the host: two per core this process may run on, at least 8.")
    worker_state_file: str = Field("", description="A file the worker writes its start-up state to (loading, "
                                   "sizing, warming, then ready) for exec probes, e.g. the chart's "
                                   "'grep -qx ready FILE'; empty = none.")
    breaker_failures: int = Field(5, ge=1, description="Consecutive failed batches after which a worker stops "
                                                       "consuming and reports itself unhealthy.")
    breaker_cooldown_s: float = Field(300.0, ge=0, description="Seconds after which a tripped worker tries one "
                                                               "batch again; 0 = stay stopped until restarted.")
    # security (infra/api/auth.py, infra/api/limits.py, infra/submission/url_policy.py)
    auth_required: bool = Field(False, description="Require a tenant's X-API-Key on /v1 routes; off: keys optional, "
                                                   "anonymous requests are tenant 'public'.")
    admin_tenants: str = Field("", description="Comma-separated tenants that see farm-wide details "
                                                "(every tenant's job ids in GET /v1/workers).")
    metrics_token: SecretStr = Field(SecretStr(""), description="Bearer token Prometheus sends to scrape /metrics "
                                     "(Authorization: Bearer …); an admin tenant's key works too. Empty and auth off: "
                                     "/metrics is open. It also reads /v1/queues (KEDA's metrics-api scaler).")
    metrics_cache_s: float = Field(5.0, ge=0, description="Seconds one /metrics answer is reused by every scrape.")
    health_cache_s: float = Field(1.0, ge=0, description="Seconds one /healthz evaluation (Redis PING, the S3 "
                                  "check, unhealthy workers) is reused by every probe of this API process.")
    health_s3_cache_s: float = Field(10.0, ge=0, description="Seconds /healthz reuses its S3 check's answer.")
    quota_outstanding_jobs: int = Field(200_000, ge=0, description="Per-tenant queued + running jobs; more → 429 "
                                                                   "(one request over it: 413). 0 = no quota.")
    quota_gpu_seconds: float = Field(7 * 24 * 3600.0, ge=0, description="Per-tenant outstanding estimated "
                                     "GPU-seconds (pool's s_per_mpx_step × Mpx × steps); 0 = no quota.")
    quota_outstanding_bytes: int = Field(
        128 * 2**20, ge=0, description="Per-tenant outstanding bytes of job records in Redis (the request's "
        "JSON as stored + 2,560 per job, infra/state/quota.py); 0 = no quota. 128 MiB: five tenants at their "
        "limit hold about half of the chart's Redis (maxmemory 1200mb, never evicting), leaving the "
        "rest to ended jobs' records (kept RENDERFARM_JOB_TTL_S), the broker's messages and the AOF rewrite's "
        "copy-on-write; "
        "it is ~47,000 typical jobs (~2.8 KB each) or ~900 of the largest (~145 KB of UTF-8 prompts and metadata).")
    quota_hold_s: int = Field(
        60, ge=1, description="Seconds a submission's quota reservation is held until its batch is recorded; "
        "past it, the reaper gives back the reservation of a batch that never was (an API killed between the "
        "two writes). Keep it well above the longest submission (10,000 jobs: about 0.5 s).")
    idempotency_claim_s: int = Field(
        30, ge=1, description="Seconds an Idempotency-Key stays claimed by a submission in flight (a retry "
        "meanwhile: 409 with Retry-After); a claim left by a killed API frees itself after this. Keep it well "
        "above the longest submission.")
    default_s_per_mpx_step: float = Field(0.05, gt=0, description="Seconds per megapixel-step of a pool that "
                                                                  "declares none (quotas, fair share).")
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body, bytes; larger → 413. "
                                                                 "10,000 typical requests are ~3.7 MB of JSON.")
    rate_limit_requests_per_s: float = Field(50.0, ge=0, description="Per-tenant API requests/s; 0 = no limit.")
    rate_limit_request_burst: int = Field(200, ge=1, description="Per-tenant request burst (token-bucket size).")
    rate_limit_jobs_per_s: float = Field(100.0, ge=0, description="Per-tenant submitted jobs/s; 0 = no limit.")
    rate_limit_job_burst: int = Field(
        20_000, ge=1, description="Per-tenant job burst; a batch larger than it is a 413.")
    webhook_allow_private: bool = Field(False, description="Allow webhook hosts on loopback/private/link-local "
                                                           "addresses (SSRF guard off for webhooks; input URLs "
                                                           "have RENDERFARM_INPUT_ALLOW_PRIVATE).")
    # webhooks on batch completion (infra/api/webhooks/delivery.py)
    webhooks_enabled: bool = Field(True, description="Run the webhook dispatcher inside the status API process.")
    webhook_secret: str = Field("", description="Ignored: webhooks are signed with each tenant's own secret "
                                                "(GET /v1/webhooks/secret), the Standard Webhooks way.")
    webhook_max_attempts: int = Field(5, ge=1, le=20, description="Delivery attempts per batch before giving up.")
    webhook_backoff_s: float = Field(2.0, gt=0, description="Wait before the 2nd attempt, seconds; doubles each "
                                                            "attempt, capped at 300 s.")
    webhook_timeout_s: float = Field(10.0, gt=0, le=60, description="Per-attempt HTTP timeout, seconds.")
    webhook_poll_s: float = Field(1.0, gt=0, description="Seconds between two looks for finished batches.")
    # compatible APIs (infra/api/compat/a1111.py, openai_images.py) and Celery's own tools
    sync_timeout_s: float = Field(600.0, gt=0, le=24 * 3600, description="Longest a synchronous request of the "
                                  "A1111 or OpenAI Images API waits for its images, seconds; then its jobs are "
                                  "canceled and it answers 504.")
    celery_task_events: bool = Field(False, description="Workers send Celery task events (received, started, "
                                     "succeeded, failed) for every job, for Flower's task views; worker events "
                                     "and remote control (celery inspect) are always on.")
    # the client settings file's S3 credentials (see the class docstring and s3_credentials)
    aws_access_key_id: str = Field("", validation_alias=AliasChoices("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
                                   description="S3 access key (boto3's standard variable).")
    aws_secret_access_key: SecretStr = Field(SecretStr(""), validation_alias=AliasChoices(
        "aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"), description="S3 secret key (boto3's standard variable).")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then the environment, then the client settings file (:func:`env_file_path`)."""
        path = env_file_path()
        file = () if path is None else (DotEnvSettingsSource(settings_cls, env_file=path),)
        return init_settings, env_settings, *file, file_secret_settings

    @property
    def state_url(self) -> str:
        """The job-state store's Redis URL: ``state_redis_url``, else ``redis_url``."""
        return self.state_redis_url or self.redis_url

    @property
    def upscaler_names(self) -> tuple[str, ...]:
        """``upscalers`` as a tuple of specs, in order (empty: none allowed without declared pools)."""
        return tuple(dict.fromkeys(u.strip() for u in self.upscalers.split(",") if u.strip()))

    @property
    def admin_tenant_set(self) -> frozenset[str]:
        """``admin_tenants`` as a set of tenant names (empty: no admin tenant)."""
        return frozenset(t.strip() for t in self.admin_tenants.split(",") if t.strip())

    def resolved_upload_threads(self) -> int:
        """:attr:`upload_threads`, or for 0 two per core of this process's CPU affinity (the
        cores a cgroup cpuset grants), at least 8. Threads encoded PNGs faster than a process pool
        of the same size on this machine class (``renderfarm bench encode``, 512² on 2 cores:
        Pillow 76.5 against 66.4 images/s, fpng 840.7 against 453.6), and the second thread per
        core encodes while the first waits on its PUT."""
        if self.upload_threads:
            return self.upload_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(8, 2 * cores)

    def s3_credentials(self) -> dict[str, str]:
        """Keyword arguments for ``boto3.client``: the client settings file's S3 keys when the
        environment has none (so ``renderfarm worker`` in another shell reaches ``renderfarm up``'s
        SeaweedFS), else nothing, leaving boto3's own chain (environment with session token,
        ``~/.aws``, instance roles) in charge."""
        if os.environ.get("AWS_ACCESS_KEY_ID") or not self.aws_access_key_id:
            return {}
        return {"aws_access_key_id": self.aws_access_key_id,
                "aws_secret_access_key": self.aws_secret_access_key.get_secret_value()}

    @field_validator("loras", "controls", "pools", "brokers", mode="before")
    @classmethod
    def _json(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):  # RENDERFARM_LORAS, _CONTROLS, _POOLS: a JSON list; _BROKERS: an object; empty: none
            return json.loads(v) if v.strip() else ({} if info.field_name == "brokers" else [])
        return v

    @field_validator("pools", mode="after")
    @classmethod
    def _unique_pools(cls, v: list[PoolSpec]) -> list[PoolSpec]:
        return check_unique(v)

    @model_validator(mode="after")
    def _pool_brokers(self) -> "Settings":
        check_brokers(self.brokers, self.pools)
        return self

    def pool_broker_url(self, pool: str) -> str:
        """The broker URL of the pool named ``pool``: its shard's when it names one, else :attr:`redis_url`."""
        shard = next((p.broker for p in self.pools if p.name == pool), None)
        return self.redis_url if shard is None else self.brokers[shard]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment (and the client settings file) on first use."""
    return Settings()
