"""The local stack: the whole farm on one machine (``renderfarm up``, ``renderfarm demo``, the
benchmarks and the test fixtures), as supervised child processes.

Place in the data flow: beside it. :mod:`~infra.localstack.processes` runs child processes
(on :mod:`~infra.localstack.ports` and :mod:`~infra.localstack.run_dirs`),
:mod:`~infra.localstack.supervisor` restarts them, :mod:`~infra.localstack.services` defines
redis-server, SeaweedFS, the API and the workers, :mod:`~infra.localstack.stack` composes
them, :mod:`~infra.localstack.cli` is ``renderfarm up``. Nothing in the production path imports it.
"""

from infra.localstack.ports import LOCALHOST, free_port
from infra.localstack.processes import ManagedProcess, ProcessExited, group_members, started_processes
from infra.localstack.run_dirs import new_run_dir
from infra.localstack.services import ApiServer, RedisServer, SeaweedS3, WorkerProcess, redis_answers, start_workers
from infra.localstack.stack import LocalStack, apply_env, ensure_bucket, patched_environ, restore_env, stack_env

__all__ = [
    "LOCALHOST", "ApiServer", "LocalStack", "ManagedProcess", "ProcessExited", "RedisServer", "SeaweedS3",
    "WorkerProcess", "apply_env", "ensure_bucket", "free_port", "group_members", "new_run_dir", "patched_environ",
    "redis_answers", "restore_env", "stack_env", "start_workers", "started_processes",
]
