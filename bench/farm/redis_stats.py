"""Command and byte counts of one redis-server, for the farm benches' Redis rows.

Place in the data flow: beside it. :mod:`bench.farm.farm` reads a :class:`RedisCounter` of its
private stack's redis-server around the measured rounds; :mod:`bench.farm.saturation` reports them.
"""

from __future__ import annotations

import redis


class RedisCounter:
    """Command and byte counts of one redis-server between :meth:`reset` and :meth:`read`."""

    def __init__(self, url: str):
        self.r = redis.Redis.from_url(url, decode_responses=True)

    def reset(self) -> None:
        """Zero the server's command and network statistics (``CONFIG RESETSTAT``)."""
        self.r.config_resetstat()

    def read(self, jobs: int) -> dict:
        """Per job (``jobs`` > 0): commands by name, all commands, network bytes in and out. The
        reading's own INFO calls are excluded."""
        stats = self.r.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
        calls["info"] = max(0, calls.get("info", 0) - 1)
        net = self.r.info("stats")
        per_job = {k: round(v / jobs, 3) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v}
        return {"jobs": jobs, "commands_per_job": round(sum(calls.values()) / jobs, 2),
                "by_command_per_job": per_job,
                "net_in_bytes_per_job": round(net["total_net_input_bytes"] / jobs, 1),
                "net_out_bytes_per_job": round(net["total_net_output_bytes"] / jobs, 1)}

    def used_memory(self) -> int:
        """``used_memory`` in bytes."""
        return int(self.r.info("memory")["used_memory"])

    def job_memory(self, job_key: str) -> int | None:
        """``MEMORY USAGE`` of one key, bytes (None when it is absent)."""
        return self.r.memory_usage(job_key, samples=0)
