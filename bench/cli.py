"""``renderfarm bench pipeline|profile|farm|submit|messages …``: the benchmark commands.

Place in the data flow: beside it. ``bench pipeline`` measures the pipeline package alone
against diffusers (:mod:`bench.pipeline`); ``bench profile`` shows where one hot render's time,
kernels and host-device syncs go; ``bench farm`` measures the whole path, producer → Redis →
worker → S3 → job state (:mod:`bench.farm.farm`); ``bench submit`` one batch submission
alone (:mod:`bench.farm.submit`); ``bench messages`` the broker's cost per job, one message per
job against one per group (:mod:`bench.farm.messages`). This module only registers the arguments
(the handlers that run each command are :mod:`bench.handlers`): the CLI root imports it at start,
so the heavy modules (torch, diffusers, celery) are imported inside the handlers.

``bench ready`` measures a worker's time to ready, cold and with the compile cache
(:mod:`bench.pipeline.time_to_ready`).

``python -m bench.cli pipeline|profile|ready …`` runs the same commands without the CLI root,
whose other commands import Celery, Redis and FastAPI: for a GPU machine that carries only what
the pipeline needs (``deploy/gpu/bench-gpu.sh``).
"""

from __future__ import annotations

import argparse
import sys

from bench import handlers


def _csv(cast):
    def parse(text: str):
        try:
            return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _batch(text: str):
    """A batch size: an integer >= 1, or ``pool``."""
    if text == "pool":
        return text
    value = int(text)
    if value < 1:
        raise ValueError(f"batch size must be >= 1 or pool, got {value}")
    return value



def _render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="offline name (tiny, sd15-arch, sd-turbo-arch, …), hub id or path")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance-scale", type=float, default=None,
                   help="default: a render request's default (7.5), for every row alike")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, …")
    p.add_argument("--cache-dir", default=None, help="offline model cache (default RENDERFARM_CACHE_DIR)")
    p.add_argument("--json", default=None, help="write the result here")


SPEC_HELP = ("reference (diffusers at the model's recommended dtype, eager, SDPA; alias baseline), peer (diffusers' "
             "fast-diffusion tutorial: bf16, fused QKV, channels_last, torch.compile max-autotune), sdnq-uint4 (the "
             "SDNQ uint4 model card: uint4 weights, explicit quantized matmul), or a farm recipe (exact, fast, a "
             "device class). Flags after '+': batch_invariant. Options after ':' as key=value, several joined "
             "with '+': 'exact:fuse_qkv=false+num_threads=1', 'peer:compile_mode=default', 'reference:dtype=float32'; "
             "experiments on any row: sdpa=flash|cudnn|efficient|math (pin PyTorch's attention backend), fp8=true "
             "(torchao float8 on the denoiser, CUDA cc >= 8.9), first_block_cache=0.1 (diffusers' First Block "
             "Cache, approximate)")

def _size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` in pixels."""
    width, sep, height = text.lower().partition("x")
    if not sep:
        raise ValueError(f"size must be WIDTHxHEIGHT, got {text!r}")
    return int(width), int(height)



def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench pipeline``, ``bench profile``, ``bench farm``, ``bench submit``, ``bench messages``,
    ``bench redis``, ``bench ready``, ``bench s3``, ``bench encode`` and ``bench upload`` to the CLI."""
    bench = subparsers.add_parser("bench", help="benchmarks: the pipeline against diffusers, its profile, the farm")
    _add_commands(bench.add_subparsers(dest="bench", required=True, metavar="WHAT"))
    return bench


def _add_commands(sub) -> None:
    """Every bench command, in the order ``--help`` lists them (the CLI root and :func:`build_parser`)."""
    for add in (_register_pipeline, _register_show, _register_profile, _register_farm, _register_submit,
                _register_messages, _register_redis, _register_durable, _register_ready, _register_io):
        add(sub)


def _register_pipeline(sub) -> None:
    from_recipes = "reference,peer,exact,fast,exact+batch_invariant"
    p = sub.add_parser("pipeline", help="the farm's recipes beside diffusers and its tutorial's recipe, one process",
                       description="Load the model once per spec and render the same prompts and seeds through "
                                   "each, interleaved over --repeats rounds (or one spec after another with "
                                   "--sequential). Prints load/cold/hot seconds, it/s, images/s, peak allocated and "
                                   "reserved MiB, PSNR against the reference, FLOPs per image and the % of the "
                                   "measured bf16 GEMM rate; --table modelcard prints the SDNQ model card's table "
                                   "instead; --json writes it all.")
    _render_arguments(p)
    p.add_argument("--batch-sizes", type=_csv(_batch), default=(1, 4),
                   help="comma list of integers and/or 'pool' (the batch a worker of the first farm recipe would "
                        "pick at this size); default 1,4")
    p.add_argument("--recipes", type=_csv(str), default=tuple(from_recipes.split(",")),
                   help=f"comma list of specs (default {from_recipes}): " + SPEC_HELP)
    p.add_argument("--repeats", type=int, default=5,
                   help="timed rounds after one cold and one settle call per row (default 5)")
    p.add_argument("--sequential", action="store_true",
                   help="one spec loaded at a time (for models of which several copies do not fit on the device)")
    p.add_argument("--table", choices=("pipeline", "modelcard"), default="pipeline",
                   help="modelcard: the SDNQ model card's columns, batch 1, one spec at a time")
    p.add_argument("--no-flops", action="store_true", help="skip the FLOP count (the denoiser calls are still counted)")
    p.add_argument("--no-gemm", action="store_true",
                   help="skip the machine's GEMM rate probe of every round (the roofline columns stay empty)")
    p.add_argument("--two-stage", action="store_true",
                   help="the Rapid Diffusion path instead: --model at --target² directly vs at --target/4² + "
                        "--upscaler ×4 and --target/2² + ×2, same --steps (s/img, peak memory, speed-up)")
    p.add_argument("--upscaler", default="esrgan-x4-arch", help="--two-stage: the upscaler (default esrgan-x4-arch)")
    p.add_argument("--target", type=int, default=1024, help="--two-stage: the output side, pixels (default 1024)")
    p.add_argument("--two-stage-batch", type=int, default=1, help="--two-stage: images per call (default 1)")
    p.add_argument("--diffusion-upscaler", default=None,
                   help="--two-stage: also a row of target/4² + this diffusion upscaler ×4 (e.g. sd-x4-upscaler-arch, "
                        "the SD x4 upscaler's architecture with random weights)")
    p.add_argument("--upscale-steps", type=int, default=20,
                   help="--two-stage: the diffusion upscaler's denoising steps (default 20)")
    p.add_argument("--modes", action="store_true",
                   help="txt2img against img2img and inpainting at --strength (denoiser calls, s/img), then "
                        "adapter switches (seconds, recompiles)")
    p.add_argument("--strength", type=float, default=0.5, help="--modes: img2img/inpaint strength (default 0.5)")
    p.add_argument("--adapters", type=int, default=2, help="--modes: offline LoRAs to switch between (0: none)")
    p.add_argument("--controlnet", type=int, default=1, choices=[0, 1],
                   help="--modes: also a row of txt2img with one canny ControlNet unit (an offline tiny-controlnet "
                        "build: the model's UNet layout) and the canny preprocessing per image (0: none)")
    p.add_argument("--ip-adapter", type=int, default=1, choices=[0, 1],
                   help="--modes: also a row of txt2img with one IP-Adapter unit (an offline tiny-ip-adapter build: "
                        "the model's cross-attention layout, a tiny image encoder) (0: none)")
    p.add_argument("--video", action="store_true",
                   help="a video model (tiny-wan, tiny-ltx, wan2.1-t2v-1.3b-arch, ltx-video-arch): s/frame and peak "
                        "memory of the exact recipe, then with VAE tiling and with step caching (First Block Cache)")
    p.add_argument("--frames", type=int, default=17, help="--video: num_frames (Wan 4k+1, LTX-Video 8k+1; default 17)")
    p.add_argument("--cache-threshold", type=float, default=0.05,
                   help="--video: the step cache's threshold (FirstBlockCacheConfig; default 0.05)")
    p.add_argument("--embeds", action="store_true",
                   help="--video: build no text encoder, render from random prompt_embeds of the real shape "
                        "(the -arch builds' UMT5-XXL / T5-XXL are 5.7B / 4.8B parameters)")
    p.add_argument("--video-overrides", default="",
                   help='--video: video recipe knobs as JSON on top of exact, e.g. \'{"compile_regional": false}\'')
    p.add_argument("--modes-overrides", default=None,
                   help='--modes: recipe knobs as JSON, e.g. \'{"compile_denoiser": true}\' (adapters then hot-swap)')
    p.set_defaults(func=lambda args: sys.exit(handlers.pipeline(args)))


def _register_show(sub) -> None:
    p = _command(sub, handlers.show, "show", help="a saved bench JSON as its table (pipeline results summarized again)",
                 description="Read a `bench pipeline|ready|farm --json` file and print its table; for bench "
                             "pipeline, medians, best, spread, ratios and roofline columns are recomputed from "
                             "the rounds the file kept.")
    p.add_argument("file", help="the JSON file")
    p.add_argument("--skip-rounds", type=int, default=0,
                   help="drop every row's first N timed rounds (files whose first round was the warm-up)")


def _register_profile(sub) -> None:
    p = sub.add_parser("profile", help="kernels, syncs and time by category per denoising step (torch.profiler)",
                       description="Load one spec, render twice (cold, hot), then profile one hot render: kernel "
                                   "launches per denoising step, per scheduler.step and per denoiser call, host-"
                                   "device synchronizations (trace events and torch.cuda.set_sync_debug_mode), and "
                                   "device time by category (attention, GEMM, norm, elementwise/other); CPU time "
                                   "on the CPU.")
    _render_arguments(p)
    p.add_argument("--recipe", default="exact", help="one spec (default exact): " + SPEC_HELP)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--trace", default=None, help="also save the Chrome trace here (gzip if it ends in .gz)")
    p.set_defaults(func=lambda args: sys.exit(handlers.profile(args)))


def _register_farm(sub) -> None:
    f = sub.add_parser("farm", help="end-to-end images/s through the local stack against a bare loop",
                       description="Start a private local stack (its own redis-server, SeaweedFS, the API, "
                                   "real workers), push --jobs renders through it, and compare with the same "
                                   "renders in a bare in-process loop. Also: seconds to submit --submit-jobs "
                                   "jobs, and the worker's per-job overhead beyond the render.")
    f.add_argument("--model", required=True,
                   help="offline name, hub id, or null (no model: an image of the requested size, pipeline/null.py)")
    f.add_argument("--jobs", type=int, default=None, help="jobs to render (default: 2000 for null, 16 otherwise)")
    f.add_argument("--workers", type=int, default=1)
    f.add_argument("--batch-size", type=int, default=None, help="default: 64 for null, the recipe's otherwise")
    f.add_argument("--width", type=int, default=None, help="pixels (default: 64 for null, 256 otherwise)")
    f.add_argument("--height", type=int, default=None, help="pixels (default: 64 for null, 256 otherwise)")
    f.add_argument("--steps", type=int, default=4)
    f.add_argument("--guidance-scale", type=float, default=7.5)
    f.add_argument("--recipe", default="exact", help="the workers' recipe, and the bare loop's (default exact)")
    f.add_argument("--submit-jobs", type=int, default=10_000, help="jobs in the submission test (0 skips it)")
    f.add_argument("--submit-repeats", type=int, default=3, help="submissions timed (default 3; median)")
    f.add_argument("--rounds", type=int, default=2, help="farm and bare runs, alternating order (default 2)")
    f.add_argument("--render-ms-per-image", type=float, default=0.0,
                   help="with --model null: a simulated GPU sleeping this many ms per image of a batch "
                        "(GIL released); the table adds its efficiency (default 0: no sleep)")
    f.add_argument("--output-format", choices=("png", "webp", "jpeg"), default="png",
                   help="every request's output_format: what the workers encode (default png)")
    f.add_argument("--submit-appendfsync", type=_csv(str), default=(),
                   help="comma list of Redis appendfsync policies (everysec,always): redis-server runs with the "
                        "AOF, and the submission test times each policy, alternating (default: AOF off)")
    f.add_argument("--no-bare", action="store_true", help="skip the bare in-process loop")
    f.add_argument("--gpu-ms", type=_csv(float), default=(10.0, 30.0, 100.0),
                   help="GPU speeds, ms per image, the per-core rows size a node for (default 10,30,100)")
    f.add_argument("--json", default=None, help="write the result here")
    f.set_defaults(func=lambda args: sys.exit(handlers.farm(args)))


def _register_submit(sub) -> None:
    s = sub.add_parser("submit", help="seconds from one POST /v1/batches of --jobs jobs to its 202 answer",
                       description="Start a private local stack with no workers (its own redis-server, SeaweedFS, "
                                   "the API) and time --repeats POSTs of --jobs jobs each (body serialized "
                                   "beforehand; HTTP request to 202 answer) with the API process's CPU seconds, "
                                   "and as many RenderClient.submit_batch calls (client JSON + POST), alternating.")
    s.add_argument("--jobs", type=int, default=10_000, help="jobs per submission, 1…10,000 (default 10,000)")
    s.add_argument("--repeats", type=int, default=5, help="submissions of each kind timed (default 5; median)")
    s.add_argument("--json", default=None, help="write the result here")
    s.set_defaults(func=lambda args: sys.exit(handlers.submit(args)))


def _register_messages(sub) -> None:
    m = sub.add_parser("messages", help="broker CPU per job: one Celery message per job against one per group",
                       description="On a private redis-server, publish and consume --jobs job ids through the "
                                   "farm's Celery configuration as one message per job (the dispatcher's path) "
                                   "and as one message per --group ids, alternating for --rounds; CPU ms per job "
                                   "of publishing, consuming (kombu consumer, cheap acks) and redis-server.")
    m.add_argument("--jobs", type=int, default=5000, help="job ids per mode and round (default 5,000)")
    m.add_argument("--group", type=int, default=64, help="job ids per group message (default 64)")
    m.add_argument("--prefetch", type=int, default=128, help="messages the consumer may hold (default 128)")
    m.add_argument("--rounds", type=int, default=3, help="rounds, mode order alternating (default 3; medians)")
    m.add_argument("--json", default=None, help="write the result here")
    m.set_defaults(func=lambda args: sys.exit(handlers.messages(args)))


def _register_redis(sub) -> None:
    r = sub.add_parser("redis", help="where one redis-server saturates: null workers (0 ms) as their number grows",
                       description="Run bench farm --model null (0 ms renders, no submission test) once per worker "
                                   "count and print jobs/s, redis-server's CPU per job and share of a core, and "
                                   "Redis commands per job. Commands and bytes per job, and bytes per queued job, "
                                   "are also rows of every bench farm table.")
    r.add_argument("--workers", type=_csv(int), default=(1, 2, 4, 8), help="comma list (default 1,2,4,8)")
    r.add_argument("--jobs", type=int, default=2000)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--split-state", action="store_true",
                   help="the job-state store on a redis-server of its own: Redis CPU per job for the broker and "
                        "for the state store apart")
    r.add_argument("--broker-shards", type=int, choices=(1, 2), default=1,
                   help="2: two pools, the second's queue on a broker redis-server of its own, the jobs alternating "
                        "between them (even worker counts: half of the workers on each)")
    r.add_argument("--json", default=None, help="write the result here")
    r.set_defaults(func=lambda args: sys.exit(handlers.redis(args)))


def _register_durable(sub) -> None:
    d = sub.add_parser("durable", help="what a durable 202 costs: one batch submitted with the durable ack off, "
                                       "local and replicas",
                       description="Start a private redis-server (AOF on) with one replica, submit --rounds batches "
                                   "of --batch null jobs per RENDERFARM_DURABLE_ACK mode through the API's "
                                   "submitter (no HTTP), the modes' order rotating, and print milliseconds per "
                                   "batch (median, best, worst) and each mode's median over off.")
    d.add_argument("--batch", type=int, default=100, help="jobs per batch (default 100)")
    d.add_argument("--rounds", type=int, default=30, help="batches per mode (default 30)")
    d.add_argument("--appendfsync", default="always", help="always or everysec (default always)")
    d.add_argument("--json", default=None, help="write the result here")
    d.set_defaults(func=lambda args: sys.exit(handlers.durable(args)))


def _register_ready(sub) -> None:
    r = sub.add_parser("ready", help="a worker's time to ready: cold compile vs the compile cache, fresh processes",
                       description="In a fresh process with an empty Inductor cache directory, load the model with "
                                   "compile on and warm up every bucket x size (cold), saving the compile-cache "
                                   "artifact to a file; then in another fresh process with another empty cache "
                                   "directory, load that artifact first (cached). Prints cold and cached seconds "
                                   "from spawn to ready, their ratio and the compiles in each. No Redis, no S3.")
    r.add_argument("--model", default="tiny", help="offline name, hub id or path (default tiny)")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda, … (default auto)")
    r.add_argument("--recipe", default="exact", help="the farm recipe (default exact)")
    r.add_argument("--buckets", type=_csv(int), default=(1, 2), help="batch buckets, comma list (default 1,2)")
    r.add_argument("--sizes", type=_csv(_size), default=((64, 64),),
                   help="WIDTHxHEIGHT pixels, comma list (default 64x64)")
    r.add_argument("--steps", type=int, default=1, help="denoising steps per warm-up render (default 1)")
    r.add_argument("--guidance-scale", type=float, default=7.5,
                   help="default 7.5 (above 1: guidance doubles the batch)")
    r.add_argument("--overrides", default=None,
                   help='recipe knobs as JSON (default {"compile_denoiser": true, "compile_vae": true, '
                        '"batch_invariant": false})')
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per phase (default 3600)")
    r.add_argument("--size-batch", action="store_true",
                   help="size the batch as a worker does (measured cold, the kept record cached) and warm up its "
                        "buckets instead of --buckets")
    r.add_argument("--controls", type=_csv(str), default=(),
                   help="ControlNets the pool declares, comma list of NAME or NAME=SOURCE (NAME alone: the offline "
                        "tiny-controlnet-NAME); the warm-up renders each alone at every bucket x size, as a "
                        "compiled worker does (default: none)")
    r.add_argument("--artifact-dir", default=None, help="keep the compile-cache artifact in this folder")
    r.add_argument("--json", default=None, help="write the result here")
    r.set_defaults(func=lambda args: sys.exit(handlers.ready(args)))


def _command(sub, handler, name: str, **kw) -> argparse.ArgumentParser:
    """A ``bench`` subcommand running ``handler(args)`` (its exit status), with ``--json``."""
    p = sub.add_parser(name, **kw)
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=lambda args: sys.exit(handler(args)))
    return p


def _register_io(sub) -> None:
    s = _command(sub, handlers.s3, "s3",
                 help="the S3 client per operation: boto3 against obstore, on a private SeaweedFS",
                 description="Start SeaweedFS and time the worker's write-once PUT, the API's presigned GET "
                             "URL and HEAD through boto3 (the farm's Storage) and obstore, interleaved: client "
                             "CPU ms per operation and operations/s at each size and thread count.")
    s.add_argument("--sizes", type=_csv(int), default=(64, 512), help="PNG sides in pixels (default 64,512)")
    s.add_argument("--threads", type=_csv(int), default=(1, 8), help="callers sharing one client (default 1,8)")
    s.add_argument("--ops", type=int, default=200, help="operations per cell and round (default 200)")
    s.add_argument("--rounds", type=int, default=2, help="interleaved rounds, median shown (default 2)")
    e = _command(sub, handlers.encode, "encode",
                 help="image encoders: ms per image, bytes, lossless, A1111 parameters kept",
                 description="Encode the null renderer's render-like image at each size through Pillow PNG "
                             "(compress_level 0..9), fpng, WebP lossless and lossy (method 0), JPEG (Pillow, "
                             "simplejpeg); then the default PNG encoder on threads against a process pool.")
    e.add_argument("--sizes", type=_csv(int), default=(512, 1024), help="square sides in pixels (default 512,1024)")
    e.add_argument("--repeats", type=int, default=7, help="encodes per encoder and size, median shown (default 7)")
    e.add_argument("--pool-images", type=int, default=32, help="images per pool run (default 32)")
    u = _command(sub, handlers.upload, "upload",
                 help="worker memory while a large file uploads: multipart from the file against bytes in memory",
                 description="Start SeaweedFS, write a file of random bytes per --mb, upload it by put_file_once "
                             "(multipart from the file) and by put_once (the bytes in memory), each in a fresh "
                             "process: peak RSS increase during the call, against the file's size.")
    u.add_argument("--mb", type=_csv(float), default=(50.0,), help="file sizes in MiB (default 50)")
    c = _command(sub, handlers.cores, "cores",
                 help="host cores a GPU of a given speed needs, per image size and format",
                 description="Run bench farm --model null (no render time, one worker) once per size and "
                             "format; print host CPU per job (API + Redis + worker, SeaweedFS apart), jobs/s "
                             "per core, and the cores a GPU at each --gpu-ms needs.")
    c.add_argument("--sizes", type=_csv(int), default=(64, 512, 1024), help="square sides (default 64,512,1024)")
    c.add_argument("--formats", type=_csv(str), default=("png", "jpeg"), help="output formats (default png,jpeg)")
    c.add_argument("--gpu-ms", type=_csv(float), default=(10.0, 30.0, 100.0), help="GPU ms/img (default 10,30,100)")
    c.add_argument("--jobs", type=int, default=512)
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--rounds", type=int, default=1)


def build_parser() -> argparse.ArgumentParser:
    """The bench commands alone, the same as under the CLI root (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="renderfarm bench", description="renderfarm benchmarks")
    _add_commands(parser.add_subparsers(dest="bench", required=True, metavar="WHAT"))
    return parser


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.cli WHAT …``: the bench commands without the CLI root."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
