"""One chunk of a catalog run to the farm: its local input images uploaded, then one ``POST /v1/batches``.

Place in the data flow: the run loop (:mod:`producer.catalog.run`) hands a chunk of content keys
here → ``POST /v1/uploads`` for each local input file not yet uploaded in this run → ``POST
/v1/batches`` with an idempotency key derived from the chunk's keys (and the failed or canceled
job each replaces), so a retried request whose answer was lost returns the first batch. A 413
splits the chunk in halves; a 422 fails its items with the API's reason, item by item where the
API names the job; a refused input file fails only the items that use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.schemas import RenderRequest
from producer.client import RenderClient, RenderFarmError


@dataclass
class ChunkSubmitter:
    """Submits chunks of a run's content keys (:meth:`submit`), each local input file uploaded once
    per run. ``requests``: content key → its request; ``inputs``: content key → {input key
    (``inputs/<sha256>.<ext>``) → local file}; ``prev_job``: content key → the failed or canceled
    job it replaces (the run's lookup fills it; part of the chunk's idempotency key)."""

    client: RenderClient
    requests: dict[str, RenderRequest]
    inputs: dict[str, dict[str, Path]] = field(default_factory=dict)
    priority: str = "normal"
    prev_job: dict[str, str] = field(default_factory=dict)
    uploaded: set[str] = field(default_factory=set)          # input keys uploaded in this run
    refused: dict[str, dict] = field(default_factory=dict)   # input key → why the API refused it

    def _upload_inputs(self, keys: list[str]) -> dict[str, dict]:
        """Upload the local input images of the items about to be submitted, each file once per
        run; returns ``{key: error}`` for the items whose file the API refused (they fail alone)."""
        failed: dict[str, dict] = {}
        for key in keys:
            for input_key, path in self.inputs.get(key, {}).items():
                if input_key in self.refused:
                    failed[key] = self.refused[input_key]
                    continue
                if input_key in self.uploaded:
                    continue
                try:
                    answered = self.client.upload(path)
                except RenderFarmError as exc:
                    self.refused[input_key] = failed[key] = {"type": "InputRefused",
                                                             "message": f"{path}: HTTP {exc.status_code}: {exc.detail}"}
                    continue
                if answered != input_key:
                    self.refused[input_key] = failed[key] = {
                        "type": "InputChanged", "message": f"{path}: uploaded as {answered}, planned as {input_key} "
                                                           "(the file changed during the run)"}
                    continue
                self.uploaded.add(input_key)
        return failed

    def submit(self, keys: list[str]) -> tuple[list[tuple[str, str, str]], dict[str, dict]]:
        """POST one chunk; returns ``([(key, job_id, batch_id)…], {key: error})``. A 413 splits
        the chunk in halves; a 422 fails its items with the API's reason."""
        ident = hashlib.sha256("\n".join(f"{k}:{self.prev_job.get(k, '')}" for k in keys).encode()).hexdigest()
        refused = self._upload_inputs(keys) if self.inputs else {}
        if refused:
            keys = [k for k in keys if k not in refused]
            if not keys:
                return [], refused
            ok, errors = self.submit(keys)
            return ok, {**refused, **errors}
        try:
            accepted = self.client.submit_batch([self.requests[k] for k in keys], priority=self.priority,
                                                idempotency_key=f"catalog-{ident}")
        except RenderFarmError as exc:
            if exc.status_code == 413 and len(keys) > 1:
                half = len(keys) // 2
                (ok1, err1), (ok2, err2) = self.submit(keys[:half]), self.submit(keys[half:])
                return ok1 + ok2, {**err1, **err2}
            return [], self._refusal(keys, exc)
        except httpx.HTTPError as exc:
            return [], {k: {"type": "SubmitError", "message": f"{type(exc).__name__}: {exc}"} for k in keys}
        return [(k, j, accepted.batch_id) for k, j in zip(keys, accepted.job_ids)], {}

    @staticmethod
    def _refusal(keys: list[str], exc: RenderFarmError) -> dict[str, dict]:
        per_job: dict[int, str] = {}
        if exc.status_code == 422 and isinstance(exc.detail, list):
            for err in exc.detail:
                loc = err.get("loc", []) if isinstance(err, dict) else []
                if len(loc) > 2 and loc[:2] == ["body", "jobs"] and isinstance(loc[2], int):
                    per_job[loc[2]] = f"{'.'.join(str(x) for x in loc[3:])}: {err.get('msg')}"
        general = f"HTTP {exc.status_code}: {exc.detail}"
        return {k: {"type": "Refused", "message": per_job.get(i, general)[:2000]} for i, k in enumerate(keys)}
