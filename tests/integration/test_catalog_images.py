"""Catalogs of products with photos against the session farm: ``image`` and ``mask`` columns
(local files next to the catalog, or https URLs on a real loopback server), uploaded by the run,
hashed into the content keys; a re-run renders nothing, a changed photo renders only its item (with
the new photo's pixels), a bad photo fails only its item."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
from PIL import Image

from infra.storage.images import parse_parameters, read_parameters
from producer.catalog import run_catalog
from producer.local_inputs import file_sha256

pytestmark = pytest.mark.integration
SMALL = {"width": 64, "height": 64, "num_inference_steps": 4}


def _photo(path, seed: int):
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def test_a_catalog_of_products_with_photos(client, tmp_path):
    nonce = uuid.uuid4().hex[:8]
    for i in range(3):
        _photo(tmp_path / f"p{i}.png", i)
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    (tmp_path / "products.csv").write_text(
        "id,name,image,mask,strength\n"
        "mug,a mug,p0.png,,0.5\n"
        "lamp,a lamp,p1.png,mask.png,0.75\n"
        "chair,a chair,p2.png,,\n"
        "sofa,a sofa,,,\n", encoding="utf-8")
    template = f"{{name}} on a kitchen table, {nonce}"
    args = [sys.executable, "-m", "infra.cli", "catalog", str(tmp_path / "products.csv"), "--template", template,
            "--model", "tiny", "--width", "64", "--height", "64", "--steps", "4", "--poll-interval", "0.3"]
    reports = []
    for run in ("first", "second"):
        report_path = tmp_path / f"{run}.json"
        done = subprocess.run([*args, "--report", str(report_path)], capture_output=True, text=True, timeout=600,
                              env=os.environ.copy())
        assert done.returncode == 0, done.stderr
        reports.append(json.loads(report_path.read_text()))
        print(f"\n{run} run: rendered {reports[-1]['rendered']}, skipped {reports[-1]['skipped']}, "
              f"failed {reports[-1]['failed']}")
    first, second = reports
    assert (first["rendered"], first["failed"]) == (4, 0), first["failures"]
    assert (second["rendered"], second["skipped"], second["failed"]) == (0, 4, 0)
    by_id = {m["id"]: m for m in first["manifest"]}
    assert by_id["mug"]["inputs"] == {"image": f"inputs/{file_sha256(tmp_path / 'p0.png')}.png"}
    assert by_id["lamp"]["inputs"]["mask"] == f"inputs/{file_sha256(tmp_path / 'mask.png')}.png"
    assert "inputs" not in by_id["sofa"]
    modes = {i: parse_parameters(read_parameters(client.fetch_bytes(client.job(m["job_id"]))) or "").get("Mode")
             for i, m in by_id.items()}
    assert modes == {"mug": "img2img", "lamp": "inpaint", "chair": "img2img", "sofa": None}

    _photo(tmp_path / "p1.png", 99)  # the lamp's photo changes: only the lamp renders again
    changed = run_catalog(tmp_path / "products.csv", template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert (changed["rendered"], changed["skipped"], changed["failed"]) == (1, 3, 0), changed["failures"]
    assert {m["id"]: m["inputs"]["image"] for m in changed["manifest"] if m["id"] == "lamp"} == {
        "lamp": f"inputs/{file_sha256(tmp_path / 'p1.png')}.png"}

    (tmp_path / "p2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # a broken photo fails its item alone
    (tmp_path / "p3.png").write_bytes((tmp_path / "p0.png").read_bytes())
    (tmp_path / "more.csv").write_text("id,name,image\nok,a vase,p3.png\nbad,a chair,p2.png\n", encoding="utf-8")
    mixed = run_catalog(tmp_path / "more.csv", f"{{name}}, {nonce} 2", client=client, model="tiny", params=SMALL,
                        poll_s=0.3)
    assert (mixed["rendered"], mixed["failed"]) == (1, 1), mixed
    assert [f["id"] for f in mixed["failures"]] == ["bad"]


def test_cli_submit_with_a_photo_and_a_mask(client, tmp_path):
    _photo(tmp_path / "photo.png", 7)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    base = [sys.executable, "-m", "infra.cli", "submit", "--prompt", "the mug in a snowy scene", "--model", "tiny",
            "--width", "64", "--height", "64", "--steps", "4", "--init-image", str(tmp_path / "photo.png")]
    done = subprocess.run([*base, "--mask", str(tmp_path / "mask.png"), "--strength", "0.6", "--wait",
                           "--timeout", "300"], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.split()[0]
    [job] = client.wait(batch_id, timeout=60)
    assert job.request.mode == "inpaint" and job.request.strength == 0.6
    assert job.request.init_image == f"inputs/{file_sha256(tmp_path / 'photo.png')}.png"
    refused = subprocess.run([*base, "--lora", "brand:0.8"], capture_output=True, text=True, timeout=120,
                             env=os.environ.copy())
    assert refused.returncode == 2 and "no adapter 'brand'" in refused.stderr, refused.stderr


def test_a_url_photo_is_keyed_by_its_bytes(client, tmp_path, https_folder, monkeypatch):
    served, base = https_folder.folder, https_folder.url
    monkeypatch.setenv("SSL_CERT_FILE", str(https_folder.cert))  # the producer's CA bundle: the site's certificate
    nonce = uuid.uuid4().hex[:8]
    _photo(served / "mug.png", 1)
    (tmp_path / "urls.csv").write_text(f"id,name,image,strength,seed\nmug,a mug,{base}/mug.png,0.5,5\n",
                                       encoding="utf-8")  # a fixed seed: a changed photo changes nothing else
    template = f"{{name}} on a shelf, {nonce}"

    def run():
        return run_catalog(tmp_path / "urls.csv", template, client=client, model="tiny", params=SMALL, poll_s=0.3)

    first = run()
    assert (first["rendered"], first["failed"]) == (1, 0), first["failures"]
    assert first["manifest"][0]["inputs"] == {"image": f"inputs/{file_sha256(served / 'mug.png')}.png"}
    assert run()["skipped"] == 1  # same photo behind the URL: nothing renders
    _photo(served / "mug.png", 2)  # the photo behind the same URL changes: the item renders again
    changed = run()
    assert (changed["rendered"], changed["skipped"]) == (1, 0), changed
    assert changed["manifest"][0]["inputs"] == {"image": f"inputs/{file_sha256(served / 'mug.png')}.png"}
    before, after = (np.asarray(Image.open(io.BytesIO(client.fetch_bytes(client.job(r["manifest"][0]["job_id"])))),
                                dtype=np.float64) for r in (first, changed))
    # the new photo's pixels: same prompt and seed, another image
    assert (diff := np.abs(before - after).mean()) > 0.2, f"mean |difference| {diff:.3f}"
    # (mean |difference| 0…255, measured in process on the tiny model for these two photos, seed 5 and
    # 20 random nonces: 1.25–1.39; an init image the worker ignored gives 0)
    (served / "mug.png").unlink()  # gone: the item fails with the URL's answer, nothing else
    gone = run()
    assert gone["failed"] == 1 and "HTTP 404" in str(gone["failures"]), gone["failures"]
