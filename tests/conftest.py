"""Session fixtures: the farm's real processes (redis-server, SeaweedFS, the status API, Celery
workers), started once per test session on free ports and stopped at its end.

They are built on :mod:`infra.localstack`, the same classes ``renderfarm up`` uses. Nothing here
touches the Redis on 6379: the fixtures run their own servers with random S3 credentials.
Logs of every child go to one session run dir; when a test fails, the tails of the logs that
changed during it are attached to the report.

Environment knobs: ``RENDERFARM_TEST_WORKERS`` (workers in the ``workers`` fixture, default 2).

No test reads a client settings file: ``RENDERFARM_ENV_FILE`` is set to the empty string here,
before any setting is read, so a developer's ``.renderfarm/env`` (written by ``renderfarm up``)
never reaches a test or the processes it starts. Tests of that file point it elsewhere.

The machines the suite runs on reach no model hub (only package registries), so it runs with
``HF_HUB_OFFLINE=1`` unless the caller sets it: a hub lookup (``madebyollin/taesd`` for a recipe's
``tiny_vae="auto"`` on a hand-built pipeline) then fails at once, as it does on any machine
without the network, instead of after huggingface_hub's connection timeouts (one such test:
26 s with them, 6 s without). Every model a test loads is an offline build or a local path.

The suite runs with ``OMP_WAIT_POLICY=PASSIVE`` unless the caller sets it. The pytest-xdist workers,
the farm processes they start and the renders they run in-process share two cores, each with
PyTorch's OpenMP pool sized to both. libgomp's default is to spin at every barrier (it sees two
threads for two CPUs, not the other processes), so a thread spins away the slice that the thread it
waits for needs. Measured on a 2-vCPU EPYC: two processes running the same convolutions at 2
threads each took 2.4-2.6 s with the default and 0.66-0.68 s passive (0.33 s alone);
``tests/unit/pipeline/test_families.py`` and ``test_optimize.py`` side by side went from 99 / 87 s to
84 / 62 s. Like ``HF_HUB_OFFLINE``, it is set before any test imports torch (libgomp reads it when
it loads), and every child inherits it.

Loads given no store of converted OpenVINO models read them from one directory for the session,
``RENDERFARM_OPENVINO_IR_DIR`` (a temporary directory, removed at the end, unless the caller sets
it): the suite loads the same tiny weights in-process again and again, and each load traced the
UNet and the VAE decoder anew (one run on a 2-vCPU EPYC: 75 traces, 370 s of a busy core, 1-13 s
each). What converting and storing do is tested with stores of their
own (``tests/unit/pipeline/test_openvino_ir.py``, ``tests/integration/test_compile_cache.py``).
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from infra.localstack import (
    ApiServer,
    RedisServer,
    SeaweedS3,
    WorkerProcess,
    apply_env,
    ensure_bucket,
    free_port,
    restore_env,
    stack_env,
    start_workers,
    started_processes,
)

os.environ["RENDERFARM_ENV_FILE"] = ""  # see the module docstring
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # see the module docstring; children inherit it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see the module docstring; before torch loads libgomp
_OWN_IR_DIR: str | None = None  # the session's OpenVINO IR directory, when this process made it
if "RENDERFARM_OPENVINO_IR_DIR" not in os.environ:  # see the module docstring; the xdist workers inherit it
    os.environ["RENDERFARM_OPENVINO_IR_DIR"] = _OWN_IR_DIR = tempfile.mkdtemp(prefix="renderfarm-test-ir-")

# A suite started in the background by a non-interactive shell (`make test &`, nohup) inherits
# SIGINT ignored, and so would `renderfarm up` and the catalog runs it starts: Python then raises
# no KeyboardInterrupt, and the tests that stop them with SIGINT (Ctrl-C) time out. A Python-level
# handler here is reset to the default at exec, so the children get Ctrl-C's usual meaning.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TEST_BUCKET = "renders-test"
TEST_MODEL = "tiny"
WORKER_BATCH_SIZE = 8

_test_started = pytest.StashKey[float]()
_file_seconds: collections.Counter[str] = collections.Counter()  # test file -> seconds, for the summary
_worker_seconds: collections.Counter[str] = collections.Counter()  # xdist worker -> seconds
_file_cpu: collections.Counter[str] = collections.Counter()  # test file -> CPU seconds, this process and children
_cpu_seen = [0.0]  # this process's CPU seconds (with its reaped children) at the last report


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every descendant it has reaped so far
    (``getrusage``: a reaped child's total includes its own reaped children), so a test's share
    includes the workers, servers and compilers it started and stopped."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every child process of the session writes its log."""
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RENDERFARM_CACHE_DIR for the session, so the tiny model is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def cache_with_shared_models(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``cache_with_shared_models(name)``: a new, otherwise empty cache dir whose ``models/`` is the
    session ``cache_dir``'s, so an offline model is built once per session whichever cache asks
    first (builds are locked and renamed into place, see ``build_offline_model``). Everything
    else a cache holds (LoRAs, the stack's data, run dirs) stays apart."""
    models = cache_dir / "models"
    models.mkdir(exist_ok=True)

    def make(name: str) -> Path:
        cache = tmp_path_factory.mktemp(name)
        (cache / "models").symlink_to(models, target_is_directory=True)
        return cache

    return make


@pytest.fixture(scope="session")
def redis_server(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server on a free port, with the AOF on so a restart keeps the queue."""
    server = RedisServer(free_port(), appendonly=True, dir=tmp_path_factory.mktemp("redis"), run_dir=run_dir)
    with server:
        yield server


@pytest.fixture
def redis_db(redis_server: RedisServer) -> Iterator[Callable[[int], Any]]:
    """``redis_db(n)``: a client (``decode_responses=True``) on database ``n`` of the session's
    redis-server, flushed now and again after the test. Database 0 is the session farm's (its API,
    reaper and workers); tests that need a Redis of their own take another number."""
    opened: list[Any] = []

    def open_db(db: int) -> Any:
        client = redis_server.client(db)
        client.flushdb()
        opened.append(client)
        return client

    yield open_db
    for client in opened:
        client.flushdb()
        client.close()


@pytest.fixture(scope="session")
def s3_server(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """SeaweedFS S3 on free ports with random credentials."""
    server = SeaweedS3(
        dir=tmp_path_factory.mktemp("seaweedfs"),
        access_key=f"test{secrets.token_hex(6)}",
        secret_key=secrets.token_urlsafe(24),
        run_dir=run_dir,
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def farm_env(redis_server: RedisServer, s3_server: SeaweedS3, cache_dir: Path) -> Iterator[dict[str, str]]:
    """The RENDERFARM_* and AWS_* variables of the test farm, also set in ``os.environ``.

    The bucket exists; the API URL names a free port (the ``api_server`` fixture serves it).
    The settings cache is cleared on the way in and out.
    """
    env = stack_env(
        redis_url=redis_server.url,
        s3_endpoint_url=s3_server.url,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        bucket=TEST_BUCKET,
        api_url=f"http://127.0.0.1:{free_port()}",
        cache_dir=cache_dir,
    )
    previous = apply_env(env)
    try:
        ensure_bucket(env)
        yield env
    finally:
        restore_env(previous)


@pytest.fixture(scope="session")
def api_server(farm_env: dict[str, str], run_dir: Path) -> Iterator[ApiServer]:
    """The status API at ``farm_env["RENDERFARM_API_URL"]``."""
    server = ApiServer(urlsplit(farm_env["RENDERFARM_API_URL"]).port, farm_env, run_dir=run_dir)
    with server:
        yield server


@pytest.fixture(scope="session")
def workers(farm_env: dict[str, str], run_dir: Path) -> Iterator[list[WorkerProcess]]:
    """``RENDERFARM_TEST_WORKERS`` (default 2) workers on the tiny model, batch size 8, all ready."""
    count = int(os.environ.get("RENDERFARM_TEST_WORKERS", "2"))
    procs = [
        WorkerProcess(TEST_MODEL, farm_env, f"test-{TEST_MODEL}-{i + 1}", WORKER_BATCH_SIZE, run_dir=run_dir)
        for i in range(count)
    ]
    try:
        start_workers(procs)
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def client(api_server, workers):
    """A ``RenderClient`` of the session farm (its API and workers running), one per test module."""
    from producer import RenderClient

    with RenderClient() as c:
        yield c


# -- order -----------------------------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files marked ``long`` first, each file's tests kept together and in order.

    ``make test`` hands whole files to pytest-xdist workers in collection order
    (``--dist loadfile --no-loadscope-reorder``): starting the files that take minutes first keeps
    one of them from being the last file left while the other worker idles (longest first, as in
    the classic LPT rule for scheduling jobs on parallel machines)."""
    long_files = {item.path for item in items if item.get_closest_marker("long") is not None}
    items.sort(key=lambda item: item.path not in long_files)  # stable: the rest keeps its order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` on three or more workers gets a lane for the files that mostly wait
    (:mod:`tests.xdist_lanes`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_lanes import LaneScheduling

    return LaneScheduling(config, log)


# -- the fault table -------------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Gather the fault rows and the CPU seconds that a test phase recorded (moved into its report
    below, so they reach the pytest-xdist controller with the report), and its wall seconds."""
    from tests.fault_table import collect

    path = report.nodeid.partition("::")[0]
    for name, value in report.user_properties:
        if name == "fault_row":
            collect(value)
        elif name == "cpu_s":
            _file_cpu[path] += value
    _file_seconds[path] += report.duration
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
    _worker_seconds[worker] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault table of the scenarios run in this session (tests/faults, scenario o), if any;
    then the slowest test files, with the CPU seconds each used (its own process and the processes
    it started and reaped: on a machine whose cores are all busy, CPU seconds, not wall seconds,
    say where the suite's time goes), and each pytest-xdist worker's busy time (seconds of setup,
    call and teardown summed), which show how evenly ``--dist loadfile`` spread the files."""
    from tests.fault_table import format_table, rows

    if rows():
        terminalreporter.write_sep("=", "fault-injection table")
        terminalreporter.write_line(format_table(rows()))
    if len(_file_seconds) > 1:
        terminalreporter.write_sep("=", "slowest files (wall s, CPU s)")
        for path, seconds in _file_seconds.most_common(15):
            terminalreporter.write_line(f"{seconds:8.1f} {_file_cpu[path]:8.1f}  {path}")
        terminalreporter.write_line(f"CPU seconds in all: {sum(_file_cpu.values()):.0f}")
        busy = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in sorted(_worker_seconds.items()))
        terminalreporter.write_line(f"busy time per worker: {busy}")
        _write_file_times()


def _write_file_times() -> None:
    """Every file's wall and CPU seconds, and each worker's busy seconds, to
    ``test-artifacts/files.json`` (the summary prints the slowest fifteen only)."""
    import json

    out = Path(__file__).resolve().parents[1] / "test-artifacts" / "files.json"
    out.parent.mkdir(exist_ok=True)
    files = {path: {"wall_s": round(seconds, 1), "cpu_s": round(_file_cpu[path], 1)}
             for path, seconds in _file_seconds.most_common()}
    out.write_text(json.dumps({"files": files, "workers": dict(sorted(_worker_seconds.items()))}, indent=1))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's OpenVINO IR directory goes with the session that made it (the controller;
    the xdist workers inherited its path)."""
    if _OWN_IR_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_IR_DIR, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start counting CPU seconds after collection (imports of every test module), so the first
    test file's share is its own."""
    _cpu_seen[0] = _cpu_seconds()


# -- log tails on failure -------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_test_started] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Move the fault rows recorded during this phase into its report; attach the tails of child
    logs written during a failed test to its report."""
    from tests.fault_table import take_recorded

    outcome = yield
    report = outcome.get_result()
    report.user_properties.extend(("fault_row", row) for row in take_recorded())
    cpu = _cpu_seconds()
    report.user_properties.append(("cpu_s", cpu - _cpu_seen[0]))
    _cpu_seen[0] = cpu
    if not report.failed:
        return
    since = item.stash.get(_test_started, 0.0) - 1.0
    for process in started_processes():
        try:
            changed = process.log_path.stat().st_mtime >= since
        except OSError:
            continue
        if changed:
            report.sections.append((f"log tail: {process.name} ({process.log_path})", process.log_tail(60)))
