"""``python -m bench.pipeline.openvino_unet``: the UNet of an offline model in OpenVINO vs PyTorch, on the CPU.

Place in the data flow: beside the pipeline; decides whether OpenVINO (the engine fastsdcpu uses;
SD-Turbo 512², 1 step, 1.7 s on an i7-12700) earns a ``backend: openvino`` recipe knob for a CPU
class. ``optimum-intel`` cannot be installed beside this project's torch (it pins
``transformers<5.6``, requires torchvision and resolves torch 2.15), so the UNet is converted with
``openvino.convert_model`` directly (the ``openvino`` wheel alone installs without touching
torch). It measures one UNet call (the dominant cost: ~3/4 of an SD-Turbo 256² image's FLOPs),
batch 1 and 2 (classifier-free guidance), interleaved rounds, medians: PyTorch float32 and
bfloat16 against OpenVINO with inference precision f32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pipeline.optimize.openvino import UNetCall


def measure(model: str, size: int, batches: tuple[int, ...], rounds: int, cache_dir: Path | None) -> dict:
    """Seconds per UNet call, per (engine, batch): medians over ``rounds`` interleaved rounds."""
    import openvino as ov

    from pipeline.models import load_pipeline

    pipe = load_pipeline(model, cache_dir=cache_dir)
    unet = pipe.unet.eval()
    latent = size // 8
    ctx_dim = unet.config.cross_attention_dim
    inputs = {b: (torch.randn(b, 4, latent, latent), torch.tensor(999.0), torch.randn(b, 77, ctx_dim)) for b in batches}
    runners = {}
    runners["torch float32"] = lambda x: unet(*x, return_dict=False)[0]
    t0 = time.perf_counter()
    ov_model = ov.convert_model(UNetCall(unet), example_input=inputs[batches[0]])
    shapes = {}
    for port in ov_model.inputs:  # a dynamic batch dimension: one model for every batch size
        dims = list(port.get_partial_shape())
        if dims:
            dims[0] = ov.Dimension(-1)
        shapes[port] = ov.PartialShape(dims)
    ov_model.reshape(shapes)
    convert_s = time.perf_counter() - t0
    core = ov.Core()
    for precision in ("f32", "bf16"):
        compiled = core.compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": precision})
        runners[f"openvino {precision}"] = (lambda c: lambda x: c([t.numpy() for t in x])[0])(compiled)
    import copy

    unet_bf16 = copy.deepcopy(UNetCall(unet)).to(torch.bfloat16)
    runners["torch bfloat16"] = lambda x: unet_bf16(x[0].bfloat16(), x[1], x[2].bfloat16())
    times: dict[str, list[float]] = {f"{k} b{b}": [] for k in runners for b in batches}
    with torch.inference_mode():
        for run in runners.values():  # warm-up
            for b in batches:
                run(inputs[b])
        cells = [(k, b) for k in runners for b in batches]
        for r in range(rounds):
            for k, b in cells[r % len(cells):] + cells[:r % len(cells)]:
                t = time.perf_counter()
                runners[k](inputs[b])
                times[f"{k} b{b}"].append(time.perf_counter() - t)
    return {
        "model": model,
        "size": size,
        "rounds": rounds,
        "convert_s": round(convert_s, 1),
        "threads": torch.get_num_threads(),
        "s_per_call": {k: round(statistics.median(v), 3) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline.openvino_unet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="sd-turbo-arch")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = measure(args.model, args.size, tuple(int(b) for b in args.batches.split(",")), args.rounds, args.cache_dir)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
