"""deploy/docker's images built on this machine without a container registry.

* :class:`Dockerd`: a private ``dockerd`` (Debian's ``docker.io``) on its own unix socket, with
  ``{"bridge": "none", "iptables": false}`` so it touches neither the host's network nor its
  firewall; builds use ``--network host`` and the classic builder (``DOCKER_BUILDKIT=0``: the
  Dockerfiles' ``# syntax=`` line would make BuildKit fetch its frontend from Docker Hub).
* :func:`base_image`: a Debian bookworm image from ``debootstrap --variant=minbase`` and the
  Debian mirror apt uses here, loaded with ``docker import`` (the Dockerfiles take it as
  ``PYTHON_IMAGE``); its tarball is cached.
* :class:`WheelIndex`: a PEP 503 "simple" index on 127.0.0.1 (``python -m http.server``) holding
  the on-disk CPU torch wheel and every other package the images install, downloaded by this
  machine's pip, for the Dockerfiles' ``TORCH_INDEX_URL`` and ``PIP_INDEX_URL``.

The cache (``RENDERFARM_DOCKER_CACHE``, default ``~/.cache/renderfarm/docker``) keeps the
debootstrap tarball, the wheels and dockerd's data root (its layer cache), so a rerun rebuilds
in seconds. Docker's references: https://docs.docker.com/reference/cli/dockerd/ and
https://docs.docker.com/reference/cli/docker/image/import/; debootstrap(8).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.localstack import free_port
from tests.deploy.conftest import ROOT

CACHE = Path(os.environ.get("RENDERFARM_DOCKER_CACHE") or Path.home() / ".cache" / "renderfarm" / "docker")
SUITE = "bookworm"
BASE_TAG = f"renderfarm/debian-base:{SUITE}-minbase"
TORCH_VERSION = "2.13.0"


#: Where a Docker Engine listens when one runs here (rootful, then rootless).
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock",
                  f"{os.environ.get('XDG_RUNTIME_DIR', '/run/user/' + str(os.getuid()))}/docker.sock")


def no_docker() -> str | None:
    """Why this machine has no Docker at all (a sentence), or None: no ``dockerd`` on ``PATH`` or in
    /usr/sbin, and no Docker socket (:data:`DOCKER_SOCKETS`, or ``DOCKER_HOST``'s unix socket)."""
    host = os.environ.get("DOCKER_HOST", "")
    sockets = [*DOCKER_SOCKETS, host.removeprefix("unix://")] if host.startswith("unix://") else DOCKER_SOCKETS
    if shutil.which("dockerd") or os.access("/usr/sbin/dockerd", os.X_OK) or any(map(os.path.exists, sockets)):
        return None
    return f"no Docker here: no dockerd on PATH or in /usr/sbin, no socket at {', '.join(sockets)}"


def unavailable() -> str | None:
    """Why the images cannot be built on this machine (a sentence: the reason to skip), or None.
    Installs docker.io and debootstrap with ``deploy/docker-tools.sh`` when they are missing and
    apt-get can.

    Skipped only where nothing could run them: not Linux, not root (the private dockerd is
    rootful), or no Docker at all (:func:`no_docker`) once the script has tried to install it.

    Raises:
        RuntimeError: Docker is here but ``deploy/docker-tools.sh`` failed (debootstrap could not
            be installed, apt-get failed): the image tests fail with its output.
    """
    if sys.platform != "linux":
        return f"dockerd and debootstrap need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "dockerd (rootful) and debootstrap need root; run the image tests as root"
    out = subprocess.run(["bash", str(ROOT / "deploy" / "docker-tools.sh")], capture_output=True, text=True,
                         timeout=900)
    if out.returncode == 0:
        return None
    said = (out.stderr or out.stdout).strip()[-400:] or f"deploy/docker-tools.sh exited {out.returncode}"
    absent = no_docker()
    if absent:
        return f"{absent} ({said})"
    raise RuntimeError(f"Docker is here but deploy/docker-tools.sh failed: {said}")


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def debian_mirror() -> str:
    """The Debian mirror apt uses here (``RENDERFARM_DEBIAN_MIRROR`` overrides), e.g.
    ``http://deb.debian.org/debian``."""
    if os.environ.get("RENDERFARM_DEBIAN_MIRROR"):
        return os.environ["RENDERFARM_DEBIAN_MIRROR"]
    texts = [p.read_text(errors="replace") for p in sorted(Path("/etc/apt").glob("sources.list.d/*"))
             if p.is_file()]
    if Path("/etc/apt/sources.list").is_file():
        texts.append(Path("/etc/apt/sources.list").read_text(errors="replace"))
    for text in texts:
        for m in re.finditer(r"(?:URIs:\s*|^deb\s+(?:\[[^\]]*\]\s+)?)(https?://\S+/debian)\s", text, re.M):
            return m.group(1)
    return "http://deb.debian.org/debian"


class Dockerd:
    """A private dockerd: data root under the cache (layers survive a rerun), exec root and
    socket under ``run_dir``. Only one at a time may use a data root: a file lock waits for it.

    ``docker(*args)`` runs the CLI against it; ``stop()`` (or leaving the ``with``) stops it.
    """

    def __init__(self, run_dir: Path, cache: Path = CACHE) -> None:
        self.run_dir = run_dir
        self.cache = cache
        self.socket = run_dir / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}
        self.proc: subprocess.Popen | None = None
        self._lock: int | None = None

    def __enter__(self) -> Dockerd:
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.cache / "dockerd.lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        config = self.run_dir / "daemon.json"
        config.write_text(json.dumps({"bridge": "none", "iptables": False, "ip-forward": False,
                                      "ip-masq": False}))
        self.log = open(self.run_dir / "dockerd.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [_sbin("dockerd"), "--config-file", str(config), "--data-root", str(self.cache / "data-root"),
             "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.run_dir / "dockerd.pid"),
             "-H", f"unix://{self.socket}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while self.docker("version", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.run_dir / "dockerd.log").read_text(errors="replace")[-800:]
                raise RuntimeError(f"dockerd did not start: {tail}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def docker(self, *args: str, check: bool = True, timeout: float = 120,
               input: bytes | None = None) -> subprocess.CompletedProcess:
        """``docker ARGS`` against this daemon; stdout and stderr as text."""
        out = subprocess.run(["docker", *args], env=self.env, capture_output=True, timeout=timeout, input=input)
        done = subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(errors="replace"),
                                           out.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} … exited {done.returncode}: {done.stderr[-1500:]}")
        return done

    def image_size(self, tag: str) -> int:
        """Size of an image in bytes (all its layers, as ``docker images`` counts them)."""
        return int(self.docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())

    def has_image(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False).returncode == 0

    def stop(self) -> None:
        """SIGTERM dockerd (it stops its containers first) and wait up to 30 s, then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        netns = self.run_dir / "exec" / "netns" / "default"  # dockerd leaves its nsfs bind mount
        if os.path.ismount(netns):
            subprocess.run(["umount", str(netns)], check=False, timeout=30)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def base_image(dockerd: Dockerd, tag: str = BASE_TAG) -> str:
    """``tag``: Debian ``SUITE`` minbase from debootstrap, imported into ``dockerd``.

    The rootfs tarball is cached (``CACHE/debian-SUITE-minbase.tar``, about 100 MB); debootstrap
    runs only when it is missing. Raises RuntimeError with debootstrap's output when it fails.
    """
    if dockerd.has_image(tag):
        return tag
    tarball = dockerd.cache / f"debian-{SUITE}-minbase.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=dockerd.cache) as tmp:
            rootfs = Path(tmp) / "rootfs"
            out = subprocess.run([_sbin("debootstrap"), "--variant=minbase", SUITE, str(rootfs), debian_mirror()],
                                 capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"debootstrap failed: {(out.stdout + out.stderr)[-1500:]}")
            shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            partial = tarball.with_suffix(".part")
            subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."], check=True,
                           timeout=600)
            partial.rename(tarball)
    dockerd.docker("import", "--change", 'CMD ["bash"]', str(tarball), tag, timeout=600)
    return tag


def _project(filename: str) -> str:
    """PEP 503 normalized project name of a wheel or sdist file name."""
    name = re.split(r"-\d", filename, maxsplit=1)[0] if filename.endswith((".tar.gz", ".zip")) \
        else filename.split("-", 1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _stable_port(key: str) -> int:
    """A loopback port derived from ``key`` (20000…39999) when it is free, else any free one.

    The index URL is a build argument, and a build argument that changes invalidates the layer
    cache of every RUN after it: the same port on every run keeps a rebuild cached."""
    port = 20000 + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 20000
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return port
        except OSError:
            return free_port()


class WheelIndex:
    """A PEP 503 simple index on 127.0.0.1 (``python -m http.server``) with every package the
    images install: the on-disk CPU torch wheel (pip's find-links here, e.g. /opt/wheels), the
    project's [api] and [worker] dependencies at deploy/constraints.txt's versions, open-clip-torch
    and the build backend. This machine's pip downloads them once (its index and CA settings
    apply; a container's pip would not trust a TLS-inspecting proxy's CA) into
    ``CACHE/wheels/<hash of pyproject.toml, constraints.txt, torch version>``.

    ``url`` is the index URL (``http://127.0.0.1:PORT/simple``) for the Dockerfiles'
    ``PIP_INDEX_URL`` and ``TORCH_INDEX_URL``; pip trusts plain HTTP on the loopback address.
    Raises RuntimeError with pip's output when the download fails.
    """

    def __init__(self, run_dir: Path, cache: Path = CACHE, version: str = TORCH_VERSION,
                 open_clip: str = "3.3.0") -> None:
        self.run_dir = run_dir
        # pip evaluates markers for the Python that runs it, not for the image's: Debian bookworm's
        # python3 is 3.11.2, where redis-py also wants async-timeout (python_full_version < "3.11.3").
        self.requirements = [f"torch=={version}", f"{ROOT}[api,worker]", f"open-clip-torch=={open_clip}",
                             "setuptools>=68", "wheel", "async-timeout>=4.0.3"]
        key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "deploy" / "constraints.txt")
                             .read_bytes() + " ".join(self.requirements[:1] + self.requirements[2:]).encode())
        self.files = cache / "wheels" / key.hexdigest()[:12]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> WheelIndex:
        done = self.files / ".complete"
        if not done.exists():
            self.files.mkdir(parents=True, exist_ok=True)
            out = subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest",
                                  str(self.files), "-c", str(ROOT / "deploy" / "constraints.txt"),
                                  *self.requirements], capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"pip download {self.requirements}: {out.stderr[-800:]}")
            done.touch()
        root = self.run_dir / "wheel-index"
        shutil.rmtree(root, ignore_errors=True)
        for f in self.files.iterdir():
            if f.name.startswith(".") or _project(f.name) == "renderfarm":
                continue
            project = root / "simple" / _project(f.name)
            project.mkdir(parents=True, exist_ok=True)
            (project / f.name).symlink_to(f)
        port = _stable_port(self.files.name)
        self.log = open(self.run_dir / "wheel-index.log", "ab")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                                      "--directory", str(root)], stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}/simple"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


def build(dockerd: Dockerd, dockerfile: str, tag: str, build_args: dict[str, str],
          timeout: float = 1800) -> float:
    """``docker build`` deploy/docker/``dockerfile`` from the repository root as ``tag`` with
    ``--network host``; returns the wall time in seconds. Raises RuntimeError with the build's
    last output when it fails. The build log goes to ``dockerd.run_dir/build-TAG.log``."""
    args = ["build", "--network", "host", "-f", str(ROOT / "deploy" / "docker" / dockerfile), "-t", tag]
    for k, v in build_args.items():
        args += ["--build-arg", f"{k}={v}"]
    started = time.monotonic()
    out = dockerd.docker(*args, str(ROOT), check=False, timeout=timeout)
    seconds = time.monotonic() - started
    log = dockerd.run_dir / f"build-{tag.replace('/', '_').replace(':', '_')}.log"
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"docker build {dockerfile} failed ({log}): {(out.stdout + out.stderr)[-2000:]}")
    return seconds
