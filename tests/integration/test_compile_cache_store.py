"""Compile-cache artifacts in SeaweedFS (infra/storage/compile_artifacts.py) and ``renderfarm cache ls|rm``
against them: put, get, overwrite, list with metadata, delete by key, by age, all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.storage.compile_artifacts import CompileCacheStore, object_name

pytestmark = pytest.mark.integration
FIELDS = {"model": "store-test", "revision": "offline:store-test:0", "recipe": {"name": "cpu/exact"},
          "device": {"kind": "cuda", "name": "NVIDIA H100", "compute_capability": [9, 0]},
          "versions": {"torch": "2.13.0", "triton": "3.5", "diffusers": "0.36"}, "buckets": [1, 8],
          "sizes": [[512, 512]]}


BUCKET = "compile-cache-test"  # its own bucket: `rm --all` here must not touch other tests' artifacts


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", "cache", *args], capture_output=True, text=True,
                          env={**os.environ, "RENDERFARM_S3_BUCKET": BUCKET}, timeout=120)


@pytest.fixture
def store(compile_cache_in) -> CompileCacheStore:
    return compile_cache_in(BUCKET)


def test_put_get_overwrite_list_delete(store) -> None:
    assert store.get("store-test-absent") is None
    store.put("store-test-a", b"first", FIELDS)
    store.put("store-test-a", b"second", FIELDS)  # overwrite: a repaired artifact replaces a bad one
    assert store.get("store-test-a") == b"second"
    [listed] = [a for a in store.list() if a.key == "store-test-a"]
    assert listed.bytes == 6
    assert listed.meta["model"] == "store-test" and listed.meta["device"] == "cuda NVIDIA H100 sm90"
    assert listed.meta["buckets"] == "1,8" and listed.meta["sizes"] == "512x512"
    assert "torch=2.13.0" in listed.meta["versions"]
    store.delete("store-test-a")
    assert store.get("store-test-a") is None
    with pytest.raises(ValueError):
        object_name("a/b")


def test_cli_ls_and_rm(store) -> None:
    for key in ("store-test-1", "store-test-2", "store-test-3"):
        store.put(key, b"x" * 1000, FIELDS)
    listing = _cli("ls")
    assert listing.returncode == 0, listing.stderr
    assert "store-test-1" in listing.stdout and "NVIDIA H100" in listing.stdout
    rows = [json.loads(line) for line in _cli("ls", "--json").stdout.splitlines()]
    assert {r["key"] for r in rows} >= {"store-test-1", "store-test-2", "store-test-3"}
    assert all(r["bytes"] == 1000 for r in rows if r["key"].startswith("store-test"))
    missing = _cli("rm", "store-test-1", "store-test-nope")
    assert missing.returncode == 1 and "store-test-nope" in missing.stderr
    assert store.get("store-test-1") is None and store.get("store-test-2") is not None
    assert _cli("rm").returncode == 2  # no selection: nothing deleted
    assert _cli("rm", "--older-than", "1").returncode == 0
    assert store.get("store-test-2") is not None  # written seconds ago
    assert _cli("rm", "--older-than", "0").returncode == 0
    assert store.get("store-test-2") is None and store.get("store-test-3") is None
    store.put("store-test-4", b"y", FIELDS)
    assert _cli("rm", "--all").returncode == 0 and store.list() == []


def test_ir_files_round_trip_list_as_one_entry_and_delete(store, tmp_path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    payload = os.urandom(9 * 2**20)  # over boto3's 8 MiB multipart threshold: a multipart upload
    (src / "model.bin").write_bytes(payload)
    (src / "model.xml").write_text("<net/>")
    (src / "manifest.json").write_text("{}")
    assert store.fetch_files("openvino-store-test", dest) is False  # nothing stored
    store.store_files("openvino-store-test", src, {"model": "store-test", "versions": {"openvino": "2026.4"},
                                                   "component": "vae.decoder"})
    store.put("store-test-inductor", b"z", FIELDS)
    assert store.fetch_files("openvino-store-test", dest) is True
    assert (dest / "model.bin").read_bytes() == payload and (dest / "model.xml").read_text() == "<net/>"
    listed = {a.key: a for a in store.list()}
    ir = listed["openvino-store-test"]
    assert ir.kind == "openvino-ir" and ir.bytes == len(payload) + len("<net/>") + 2
    assert ir.meta["model"] == "store-test" and "openvino=2026.4" in ir.meta["versions"]
    assert listed["store-test-inductor"].kind == "inductor"
    rows = {json.loads(line)["key"]: json.loads(line) for line in _cli("ls", "--json").stdout.splitlines()}
    assert rows["openvino-store-test"]["kind"] == "openvino-ir"
    assert rows["openvino-store-test"]["component"] == "vae.decoder"
    table = {line.split()[0]: line.split()[1] for line in _cli("ls").stdout.splitlines()[1:]}
    assert table["openvino-store-test"] == "openvino-ir:vae.decoder" and table["store-test-inductor"] == "inductor"
    assert _cli("rm", "openvino-store-test").returncode == 0  # every file of the entry goes
    assert "openvino-store-test" not in {a.key for a in store.list()}
    assert store.fetch_files("openvino-store-test", tmp_path) is False
    assert store.get("store-test-inductor") == b"z"  # the other kind is untouched


def test_cli_without_s3_credentials_says_so(tmp_path) -> None:
    """No credentials anywhere (no AWS_* variables, no ~/.aws, no client settings file): one line
    that says what to set, exit 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RENDERFARM_"))}
    env.update(HOME=str(tmp_path), RENDERFARM_ENV_FILE="", AWS_EC2_METADATA_DISABLED="true")
    done = subprocess.run([sys.executable, "-m", "infra.cli", "cache", "ls"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "no S3 credentials found; set AWS_ACCESS_KEY_ID" in done.stderr and "Traceback" not in done.stderr
