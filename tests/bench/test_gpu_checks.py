"""``python -m bench.pipeline.gpu_checks`` runs on the CPU too (CUDA parts replaced by their CPU
counterparts) and writes its JSON: families, loop synchronizations, batch_invariant cost."""

from __future__ import annotations

import json

from bench.pipeline.gpu_checks import main


def test_gpu_checks_run_on_the_cpu_and_write_their_json(tmp_path, bench_cache, monkeypatch, capsys):
    monkeypatch.setenv("RENDERFARM_CACHE_DIR", str(bench_cache))
    from infra.settings import get_settings

    get_settings.cache_clear()
    try:
        code = main(["--out", str(tmp_path), "--models", "tiny-flux", "--invariance-model", "tiny",
                     "--invariance-size", "64", "--invariance-steps", "2", "--invariance-batch", "2", "--rounds", "1",
                     "--device", "cpu", "--overrides", '{"compile_denoiser": false}'])
    finally:
        get_settings.cache_clear()
    assert code == 0
    result = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert [(r["model"], r["ok"]) for r in result["families"]] == [("tiny-flux", True)] * 2
    assert {r["scheduler"] for r in result["syncs"]} >= {"ddim", "euler_ancestral", "unipc", "lcm", "default"}
    assert all(r["syncs"] == 0 for r in result["syncs"])
    inv = result["batch_invariant"]
    assert inv["mode_on"] == "cpu-kernels" and inv["identical_alone_and_batched"]["on"] is True
    assert inv["s_per_img"]["on"] > 0 and "cost_pct" in inv
    assert "host-device synchronizations" in capsys.readouterr().out
