"""Chinese prompts through the whole farm, on ``tiny-taiyi`` (the Taiyi-Stable-Diffusion-1B-Chinese
layout: SD 1.x with a Chinese BertModel text encoder and BertTokenizer): a UTF-8 CSV catalog with
a byte-order mark through ``renderfarm catalog`` (upscaled ×2), ``renderfarm submit``, and the
HTTP API; the prompt survives in the job record, the PNG ``parameters`` and the S3 metadata (RFC
2047 encoded-words). The session farm of tests/conftest.py, plus one worker of ``tiny-taiyi``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

from infra.localstack import WorkerProcess, start_workers
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.s3 import decode_metadata
from producer import RenderClient

pytestmark = pytest.mark.integration
MODEL = "tiny-taiyi"
ROWS = [("dish-1", "红烧肉", "酱红色"), ("dish-2", "清蒸鲈鱼", "白色"), ("scroll-1", "山水画", "水墨"),
        ("dish-1-again", "红烧肉", "酱红色")]


@pytest.fixture(scope="module")
def taiyi_worker(farm_env, run_dir, api_server):
    proc = WorkerProcess(MODEL, farm_env, f"test-{MODEL}-1", 4, run_dir=run_dir)
    try:
        start_workers([proc])
        yield proc
    finally:
        proc.stop()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"}, encoding="utf-8")


def test_a_chinese_catalog_end_to_end(taiyi_worker, farm_env, s3_server, tmp_path):
    nonce = uuid.uuid4().hex[:6]
    path = tmp_path / "菜单.csv"
    path.write_text("id,name,color\n" + "".join(f"{i},{n},{c}\n" for i, n, c in ROWS), encoding="utf-8-sig")
    report_path = tmp_path / "报告.json"
    template = f"{{color}}的{{name}}，美食摄影，特写 {nonce}"
    proc = _run("catalog", str(path), "--template", template, "--model", MODEL, "--width", "64", "--height", "64",
                "--steps", "2", "--upscale", "2", "--upscaler", "tiny-esrgan-x4", "--report", str(report_path),
                "--poll-interval", "0.3", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    text = report_path.read_text(encoding="utf-8")
    assert "美食摄影" in text and "菜单.csv" in text  # readable UTF-8, not \\u escapes
    report = json.loads(text)
    shown = {k: v for k, v in report.items() if k not in ("manifest", "batches")}
    shown["manifest"] = [{k: m[k] for k in ("id", "line", "s3_key")} for m in report["manifest"]]
    print(json.dumps(shown, ensure_ascii=False, indent=1))  # the closing note's sample report
    assert (report["items"], report["distinct_images"], report["rendered"], report["failed"]) == (4, 3, 4, 0)
    s3, bucket = s3_server.client(), farm_env["RENDERFARM_S3_BUCKET"]
    prompts = {i: template.format(name=n, color=c) for i, n, c in ROWS}
    with RenderClient() as client:
        for entry in report["manifest"]:
            job = client.job(entry["job_id"])
            assert job.request.prompt == prompts[entry["id"]]
            assert (job.result.width, job.result.height) == (128, 128)
            data = httpx.get(entry["url"], timeout=30).content
            infotext = read_parameters(data)
            params = parse_parameters(infotext)
            assert params["prompt"] == prompts[entry["id"]] and params["Model"] == MODEL
            assert params["Postprocess upscaler"] == "tiny-esrgan-x4"
            head = s3.head_object(Bucket=bucket, Key=entry["s3_key"])["Metadata"]
            assert all(v.isascii() for v in head.values()) and "=?UTF-8?B?" in head["parameters"]
            assert decode_metadata(head["parameters"]) == infotext
    again = _run("catalog", str(path), "--template", template, "--model", MODEL, "--width", "64", "--height", "64",
                 "--steps", "2", "--upscale", "2", "--upscaler", "tiny-esrgan-x4", "--report", str(report_path),
                 "--poll-interval", "0.3", "--no-progress")
    assert again.returncode == 0 and json.loads(report_path.read_text(encoding="utf-8"))["skipped"] == 4


def test_a_chinese_prompt_through_the_cli_and_the_api(taiyi_worker, farm_env):
    prompt = f"穿着宇航服的哈士奇 {uuid.uuid4().hex[:6]}"
    proc = _run("submit", "--prompt", prompt, "--model", MODEL, "--width", "64", "--height", "64", "--steps", "2",
                "--wait", "--timeout", "300")
    assert proc.returncode == 0, proc.stderr
    url = farm_env["RENDERFARM_API_URL"]
    body = json.dumps({"prompt": "小桥流水人家，水彩", "model": MODEL, "width": 64, "height": 64,
                       "num_inference_steps": 2}, ensure_ascii=False).encode("utf-8")
    accepted = httpx.post(f"{url}/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert accepted.status_code in (200, 201, 202), accepted.text
    with RenderClient() as client:
        job = client.wait(accepted.json()["batch_id"], timeout=300)[0]
        assert job.state == "succeeded" and job.request.prompt == "小桥流水人家，水彩"
        assert parse_parameters(read_parameters(client.fetch_bytes(job)))["prompt"] == "小桥流水人家，水彩"
