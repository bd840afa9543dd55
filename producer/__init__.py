"""The producer side: the Python client, the CLI's submit/status/wait, the demo and catalogs.

Data flow: **producer** → status API → job-state store and pool queues → workers.
"""

from infra.schemas import BatchStatus, JobStatus, RenderRequest
from producer.client import NotFoundError, RenderClient, RenderFarmError

__all__ = ["RenderClient", "RenderRequest", "JobStatus", "BatchStatus", "NotFoundError", "RenderFarmError"]
