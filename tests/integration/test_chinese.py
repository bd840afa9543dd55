"""Chinese prompts through the whole farm, on ``tiny-taiyi`` (the Taiyi-Stable-Diffusion-1B-Chinese
layout: SD 1.x with a Chinese BertModel text encoder and BertTokenizer): a UTF-8 CSV catalog with
a byte-order mark through ``renderfarm catalog`` (upscaled ×2), ``renderfarm submit``, and the
HTTP API; the prompt survives in the job record, the PNG ``parameters`` and the S3 metadata (RFC
2047 encoded-words). Then Kolors (``tiny-kolors``: KolorsPipeline with a ChatGLM text encoder) the
same way. The session farm of tests/conftest.py, plus one worker of each model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import httpx
import numpy as np
import pytest

from infra.schemas import RenderRequest
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.s3 import decode_metadata
from producer import RenderClient

pytestmark = pytest.mark.integration
MODEL = "tiny-taiyi"
ROWS = [("dish-1", "红烧肉", "酱红色"), ("dish-2", "清蒸鲈鱼", "白色"), ("scroll-1", "山水画", "水墨"),
        ("dish-1-again", "红烧肉", "酱红色")]


@pytest.fixture(scope="module")
def taiyi_worker(start_worker, farm_env, api_server):
    return start_worker(MODEL, farm_env)


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
    assert accepted.status_code == 202, accepted.text
    with RenderClient() as client:
        job = client.wait(accepted.json()["batch_id"], timeout=300)[0]
        assert job.state == "succeeded" and job.request.prompt == "小桥流水人家，水彩"
        assert parse_parameters(read_parameters(client.fetch_bytes(job)))["prompt"] == "小桥流水人家，水彩"


KOLORS = "tiny-kolors"


@pytest.fixture(scope="module")
def kolors_worker(start_worker, farm_env, api_server):
    return start_worker(KOLORS, farm_env)


def test_kolors_renders_chinese_prompts_through_the_farm(kolors_worker, farm_env, s3_server):
    """Kolors' ChatGLM text encoder through API → Redis → worker → S3: a batch of Chinese prompts
    (one with a negative prompt, one upscaled ×2 by the latent upscaler, which takes the prompt
    too), the prompt back from the job record, the PNG ``parameters`` and the S3 metadata (RFC 2047
    encoded-words that decode to the PNG's text)."""
    nonce = uuid.uuid4().hex[:6]
    batch = [RenderRequest(prompt=f"{p} {nonce}", model=KOLORS, seed=s, width=64, height=64, num_inference_steps=2,
                           **kw) for p, s, kw in (
        ("一碗红烧肉，美食摄影", 1, {}),
        ("穿着汉服的少女，工笔画", 2, {"negative_prompt": "模糊，低质量"}),
        ("夜晚的上海外滩，霓虹灯", 3, {"upscale": 2, "upscaler": "tiny-sd-x2-latent-upscaler"}))]
    s3, bucket = s3_server.client(), farm_env["RENDERFARM_S3_BUCKET"]
    pixels = []
    with RenderClient() as client:
        jobs = client.wait(client.submit_batch(batch).batch_id, timeout=600)
        assert [j.state for j in jobs] == ["succeeded"] * len(batch), [(j.state, j.error) for j in jobs]
        for request, job in zip(batch, jobs):
            factor = request.upscale or 1
            assert job.request.prompt == request.prompt
            assert (job.result.width, job.result.height) == (64 * factor, 64 * factor)
            data = client.fetch_bytes(job)
            infotext = read_parameters(data)
            params = parse_parameters(infotext)
            assert params["prompt"] == request.prompt and params["Model"] == KOLORS
            assert params.get("negative_prompt", "") == (request.negative_prompt or "")
            head = s3.head_object(Bucket=bucket, Key=job.result.key)["Metadata"]
            assert all(v.isascii() for v in head.values()) and "=?UTF-8?B?" in head["parameters"]
            assert decode_metadata(head["parameters"]) == infotext
            pixels.append(np.asarray(client.fetch_image(job).convert("RGB")))
    assert all(p.std() > 1 for p in pixels), [p.std() for p in pixels]  # pictures, not blanks
    worker = next(w for w in httpx.get(f"{farm_env['RENDERFARM_API_URL']}/v1/workers").json()
                  if w.get("model") == KOLORS)
    assert worker["recipe"]["family"] == "kolors"
