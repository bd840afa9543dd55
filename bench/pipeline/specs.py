"""Bench specs: what one row of ``renderfarm bench pipeline`` / ``bench profile`` renders with.

Place in the data flow: the command line (``--recipes``) → :func:`parse_spec` (here) → a
:class:`BenchSpec` → :mod:`bench.pipeline.subjects`, which loads the pipeline it names.

Syntax: ``NAME[+FLAG…][:key=value[+key=value…]]`` (commas separate specs on the command line).

* ``NAME`` is ``reference`` (alias ``baseline``): diffusers as a user calls it, at the model's
  recommended dtype, eager, its default SDPA attention; ``peer``: diffusers with the recipe of
  its "Accelerate inference of text-to-image diffusion models" tutorial (bf16, fused QKV,
  channels_last, ``torch.compile(mode="max-autotune", fullgraph=True)`` of the denoiser and
  the VAE decode); ``sdnq-uint4``: diffusers with the recipe of the ERNIE-Image-Turbo SDNQ uint4
  model card (WaveCut/ERNIE-Image-Turbo-SDNQ-uint4-static: uint4 weights, quantized matmul
  enabled explicitly); anything else is a farm recipe for :func:`pipeline.recipes.recipe_for`
  (``exact``, ``fast`` or a device-class name).
* ``FLAG`` is a bench flag turned on: ``batch_invariant``.
* ``key=value`` pairs are JSON values (``true``, ``4``, ``"x"``) or plain strings. Bench keys
  (:data:`BENCH_KEYS`) are taken here; every other key is a recipe override for a farm recipe
  (validated later by :func:`pipeline.recipes.apply_overrides`) or an option of a diffusers
  subject (:data:`SUBJECT_OPTIONS`).

Examples: ``exact+batch_invariant``, ``exact:fuse_qkv=false+num_threads=1``,
``peer:compile_mode=default``, ``reference:dtype=float32``, ``exact:sdpa=cudnn``,
``fast:fp8=true``, ``exact:first_block_cache=0.1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: Subjects that are plain diffusers, not the farm's recipes.
DIFFUSERS_KINDS = ("reference", "peer", "sdnq-uint4")
ALIASES = {"baseline": "reference"}
#: Flags allowed after ``+`` in the name part.
FLAGS = ("batch_invariant",)
#: Keys the bench itself handles, for every kind of subject (:mod:`bench.pipeline.experiments`).
BENCH_KEYS = ("batch_invariant", "sdpa", "fp8", "first_block_cache")
#: ``torch.nn.attention.SDPBackend`` members a spec may pin with ``sdpa=…``.
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
#: Options of the diffusers subjects, with their types.
SUBJECT_OPTIONS: dict[str, dict[str, type]] = {
    "reference": {"dtype": str},
    "peer": {"dtype": str, "compile": bool, "compile_mode": str, "fullgraph": bool, "tuning": bool},
    "sdnq-uint4": {"dtype": str, "quantized_matmul": bool},
}


@dataclass(frozen=True)
class BenchSpec:
    """One parsed spec. ``text`` is the row's name as given; ``kind`` is one of
    :data:`DIFFUSERS_KINDS` or ``"farm"``; ``recipe`` the farm recipe name (None otherwise);
    ``options`` the recipe overrides (farm) or subject options (diffusers kinds);
    ``batch_invariant`` None means the device's default (see :mod:`bench.pipeline.adapter`);
    ``sdpa`` pins one SDPA backend for the renders (None: PyTorch chooses); ``fp8`` and
    ``first_block_cache`` (a threshold) are the approximate knobs of :mod:`bench.pipeline.experiments`."""

    text: str
    kind: str
    recipe: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    batch_invariant: bool | None = None
    sdpa: str | None = None
    fp8: bool = False
    first_block_cache: float | None = None

    @property
    def is_reference(self) -> bool:
        """Whether this is the row every other row is compared with (PSNR, speed-up)."""
        return self.kind == "reference"


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(text: str) -> BenchSpec:
    """Parse one spec (see the module docstring).

    Raises:
        ValueError: empty name, an unknown flag, a pair that is not ``key=value``, a bad
            ``sdpa`` backend, a non-boolean ``batch_invariant``, or an option a diffusers
            subject does not have (or of the wrong type).
    """
    head, _, rest = text.strip().partition(":")
    name, *flags = [p.strip() for p in head.split("+")]
    if not name:
        raise ValueError(f"bench spec {text!r} has no name")
    name = ALIASES.get(name, name)
    values: dict[str, Any] = {}
    for flag in flags:
        if flag not in FLAGS:
            raise ValueError(f"unknown flag {flag!r} in bench spec {text!r}; flags: {', '.join(FLAGS)}")
        values[flag] = True
    for item in filter(None, (p.strip() for p in rest.split("+"))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{item!r} in bench spec {text!r} is not key=value")
        values[key.strip()] = _value(value.strip())
    batch_invariant = values.pop("batch_invariant", None)
    if batch_invariant is not None and not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be true or false in {text!r}, got {batch_invariant!r}")
    sdpa = values.pop("sdpa", None)
    if sdpa is not None and sdpa not in SDPA_BACKENDS:
        raise ValueError(f"sdpa={sdpa!r} in {text!r}; expected one of {', '.join(SDPA_BACKENDS)}")
    fp8 = values.pop("fp8", False)
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8 must be true or false in {text!r}, got {fp8!r}")
    cache = values.pop("first_block_cache", None)
    if cache is not None and (isinstance(cache, bool) or not isinstance(cache, (int, float)) or not 0 < cache < 1):
        raise ValueError(f"first_block_cache must be a threshold in (0, 1) in {text!r}, got {cache!r}")
    kind = name if name in DIFFUSERS_KINDS else "farm"
    if kind != "farm":
        allowed = SUBJECT_OPTIONS[kind]
        for key, value in values.items():
            if key not in allowed:
                raise ValueError(f"{kind} has no option {key!r} (in {text!r}); options: {', '.join(allowed)}")
            if not isinstance(value, allowed[key]):
                raise ValueError(f"{kind} option {key} must be {allowed[key].__name__}, got {value!r} in {text!r}")
    return BenchSpec(text=text.strip(), kind=kind, recipe=name if kind == "farm" else None, options=values,
                     batch_invariant=batch_invariant, sdpa=sdpa, fp8=fp8,
                     first_block_cache=None if cache is None else float(cache))


def parse_specs(texts: tuple[str, ...] | list[str]) -> list[BenchSpec]:
    """Parse every spec, reference rows first (the others are compared with them), the rest in
    the given order.

    Raises:
        ValueError: a bad spec (see :func:`parse_spec`), no spec, or the same text twice.
    """
    specs = [parse_spec(t) for t in texts]
    if not specs:
        raise ValueError("no bench spec given")
    seen = [s.text for s in specs]
    dupes = sorted({t for t in seen if seen.count(t) > 1})
    if dupes:
        raise ValueError(f"bench spec(s) given twice: {', '.join(dupes)}")
    return [s for s in specs if s.is_reference] + [s for s in specs if not s.is_reference]
