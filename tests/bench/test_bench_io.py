"""``renderfarm bench s3``, ``bench encode``, ``bench cores`` and ``bench upload`` run end to end (real SeaweedFS,
real encoders, a real local stack) at small sizes and write their JSON. Timings are not asserted;
what is asserted is what the figures stand on: both S3 clients keep write-once and give a
presigned URL a plain GET can use, each encoder's losslessness and kept ``parameters``, an upload
from a file holding less memory than the file."""

from __future__ import annotations

import json

import pytest

from infra.cli import main

pytestmark = pytest.mark.bench


def run_cli(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)


def test_bench_s3_compares_both_clients_and_checks_what_adoption_keeps(tmp_path, capsys):
    out = tmp_path / "s3.json"
    run_cli(["bench", "s3", "--sizes", "64", "--threads", "1,2", "--ops", "3", "--rounds", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["checks"] == {"boto3": {"write_once": True, "presigned_get": True},
                                "obstore": {"write_once": True, "presigned_get": True}}
    cells = {(c["op"], c["threads"], c["client"]) for c in result["cells"]}
    assert cells == {(op, t, c) for op in ("put", "presign", "head") for t in (1, 2) for c in ("boto3", "obstore")}
    assert all(c["cpu_ms_per_op"] >= 0 and c["ops_per_s"] > 0 for c in result["cells"])
    assert "S3 client per operation" in capsys.readouterr().out


def test_bench_encode_reports_what_each_encoder_keeps(tmp_path, capsys):
    out = tmp_path / "encode.json"
    run_cli(["bench", "encode", "--sizes", "64", "--repeats", "1", "--pool-images", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["encoder"]: r for r in result["rows"]}
    assert set(rows) == {*(f"png-{level}" for level in range(10)), "fpng", "webp-lossless-m0", "webp-q95-m0",
                         "jpeg-q95-pillow", "jpeg-q95-simplejpeg"}
    for name, row in rows.items():
        if "missing" in row:  # an optional wheel (simplejpeg) absent here
            assert name == "jpeg-q95-simplejpeg"
            continue
        assert row["parameters_kept"], name
        assert row["lossless"] == (name.startswith("png-") or name in ("fpng", "webp-lossless-m0")), name
    assert {(p["kind"], p["workers"]) for p in result["pools"]} >= {("threads", 1), ("processes", 1)}
    assert "Encoders, CPU ms per image" in capsys.readouterr().out


def test_bench_cores_has_a_row_per_size_and_format(tmp_path, capsys):
    out = tmp_path / "cores.json"
    run_cli(["bench", "cores", "--sizes", "64", "--formats", "png,jpeg", "--jobs", "16", "--batch-size", "8",
             "--gpu-ms", "10,50", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["size"], r["format"]) for r in result["rows"]] == [(64, "png"), (64, "jpeg")]
    for row in result["rows"]:
        pc = row["per_core"]
        assert set(pc["worker_cores_for_gpu"]) == {"10.0", "50.0"}
        assert pc["host_cpu_ms_per_job"] >= pc["worker_cpu_ms_per_job"] > 0
    assert "Host cores a GPU needs" in capsys.readouterr().out


def test_bench_upload_holds_less_than_the_file_when_uploading_from_it(tmp_path, capsys):
    """A multipart upload from the file (above the 16 MiB threshold) needs a few parts' worth of
    memory, not the file; the in-memory row holds the whole body; both store every byte."""
    out = tmp_path / "upload.json"
    run_cli(["bench", "upload", "--mb", "1,48", "--json", str(out)])
    rows = {(r["method"], r["bytes"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(m, mb * 2**20) for m in ("put_file_once", "put_once") for mb in (1, 48)}
    assert all(r["written"] and r["stored_bytes"] == r["bytes"] for r in rows.values())
    from_file, in_memory = rows["put_file_once", 48 * 2**20], rows["put_once", 48 * 2**20]
    assert from_file["held_bytes"] < 2**20 and in_memory["held_bytes"] > 0.9 * in_memory["bytes"]
    assert from_file["held_bytes"] + from_file["peak_increase_bytes"] < 0.75 * from_file["bytes"]
    assert "Upload memory" in capsys.readouterr().out
