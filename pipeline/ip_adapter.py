"""IP-Adapter on the pinned pipeline: an image prompt beside the text prompt, per request.

Place in the data flow: worker → pipeline, beside :mod:`pipeline.controlnet`. IP-Adapter (Ye,
Zhang, Liu, Han and Yang, "IP-Adapter: Text Compatible Image Prompt Adapter for Text-to-Image
Diffusion Models", 2023) conditions the UNet's cross-attention on a CLIP image embedding through
its own key and value projections, beside the text's. diffusers loads one with
``load_ip_adapter`` (its image projection becomes the UNet's ``encoder_hid_proj``, its projections
``IPAdapterAttnProcessor2_0`` in every cross-attention) and sets its strength with
``set_ip_adapter_scale`` ("IP-Adapter" in diffusers' docs).

Loading changes the pinned pipeline itself: the UNet's attention processors and its
``encoder_hid_proj``, after which the UNet refuses a call without an image embedding. So an
adapter is applied around one call only (:meth:`IPAdapters.applied`): loaded from its state dict
and image encoder kept in memory, its scale set, then unloaded with diffusers'
``unload_ip_adapter`` and the pinned UNet's own attention processors put back (diffusers' unload
would install fresh default instances, dropping what the recipe chose). A compiled UNet meets
other processors there, so on a compiled worker such a call runs eager.

Sources, as ControlNets': the adapter's weights file (``image_proj.*`` and ``ip_adapter.*`` in
one safetensors file, the layout of the ``h94/IP-Adapter`` checkpoints) in a directory with its
CLIP image encoder in ``image_encoder/`` (``CLIPVisionModelWithProjection``), as a local path or a
hub id with ``subfolder``/``weight_name``; or an offline build (``tiny-ip-adapter…``:
:func:`build_offline_ip_adapter`) for tests and the demo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

#: Offline IP-Adapter sources start with this: random weights, the pinned UNet's layout.
OFFLINE_PREFIX = "tiny-ip-adapter"
#: The weights file of an IP-Adapter directory (offline builds; a real one names its own).
WEIGHT_NAME = "ip-adapter.safetensors"
#: Image tokens of a plain IP-Adapter's image projection (the paper's 4; diffusers reads it so).
IMAGE_TOKENS = 4
#: Standard deviation of the offline build's key/value projections: drawn large enough that the
#: reference image visibly steers the tiny model's images (PyTorch's default init barely does).
OFFLINE_KV_STD = 0.5
#: The offline image encoder: a 2-layer CLIP vision tower on 32² inputs with 16-dim embeddings.
OFFLINE_ENCODER = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 16}


@dataclass(frozen=True)
class IPAdapterSource:
    """Where one IP-Adapter comes from: ``path`` (a directory, or a hub id), the weights file's
    ``subfolder`` and ``weight_name`` in it, and its image encoder's folder (relative to ``path``)."""

    path: str
    subfolder: str = ""
    weight_name: str = WEIGHT_NAME
    image_encoder_folder: str = "image_encoder"


def build_offline_ip_adapter(name: str, pipe, cache_dir: Path) -> Path:
    """An offline random-weight IP-Adapter for ``pipe``'s UNet, saved once under ``cache_dir``
    (``ip-adapters/<model hash>/<name>/``: :data:`WEIGHT_NAME` and ``image_encoder/``); returns the
    directory.

    The image encoder is a tiny ``CLIPVisionModelWithProjection`` (:data:`OFFLINE_ENCODER`); the
    image projection maps its embedding to :data:`IMAGE_TOKENS` tokens of the UNet's
    ``cross_attention_dim``; each cross-attention gets ``to_k_ip``/``to_v_ip`` of its own shape,
    numbered as diffusers numbers them (1, 3, 5, … over the UNet's attention processors in order).
    Every weight is drawn under a seed derived from ``name`` (projections from
    N(0, :data:`OFFLINE_KV_STD`²)), so a name always builds the same adapter.

    Raises:
        ValueError: ``pipe`` has no ``UNet2DConditionModel`` (diffusers' IP-Adapter loader needs one).
    """
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from pipeline.models.build import addon_build_dir, name_seed, published_once

    unet = getattr(pipe, "unet", None)
    if not isinstance(unet, UNet2DConditionModel):
        raise ValueError(f"offline IP-Adapter {name!r} is made for a UNet; {type(pipe).__name__} has none")
    final = addon_build_dir(cache_dir, "ip-adapters", pipe, name)
    if (final / WEIGHT_NAME).is_file():
        return final
    seed = name_seed(name)
    generator = torch.Generator().manual_seed(seed)
    cross = int(unet.config.cross_attention_dim)
    embed = OFFLINE_ENCODER["projection_dim"]

    def draw(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * std).contiguous()

    tensors = {"image_proj.proj.weight": draw(IMAGE_TOKENS * cross, embed, std=embed ** -0.5),
               "image_proj.proj.bias": torch.zeros(IMAGE_TOKENS * cross),
               "image_proj.norm.weight": torch.ones(cross), "image_proj.norm.bias": torch.zeros(cross)}
    key_id = 1
    for proc_name in unet.attn_processors:
        if proc_name.endswith("attn1.processor"):
            continue
        attn = unet.get_submodule(proc_name.removesuffix(".processor"))
        for proj in ("to_k", "to_v"):
            rows = getattr(attn, proj).weight.shape[0]
            tensors[f"ip_adapter.{key_id}.{proj}_ip.weight"] = draw(rows, cross, std=OFFLINE_KV_STD)
        key_id += 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**OFFLINE_ENCODER))
    with published_once(final) as tmp:  # another process may build it meanwhile: theirs is kept
        encoder.save_pretrained(tmp / "image_encoder", safe_serialization=True)
        save_file(tensors, str(tmp / WEIGHT_NAME))
    return final


def _encoder_dir(source: IPAdapterSource) -> str:
    """The local directory of ``source``'s image encoder (a hub id's: its ``config.json`` fetched)."""
    root = Path(source.path)
    if root.is_dir():
        return str(root / source.image_encoder_folder)
    from huggingface_hub import hf_hub_download

    return str(Path(hf_hub_download(source.path, "config.json", subfolder=source.image_encoder_folder)).parent)


class IPAdapters:
    """The IP-Adapters one pinned pipeline may apply, each loaded once and kept in memory.

    Args:
        pipe: the pinned pipeline (SD 1/2 or SDXL: a UNet with cross-attention).
        sources: adapter name → source: an offline name (``tiny-ip-adapter…``), an
            :class:`IPAdapterSource`, or a directory / hub id in :class:`IPAdapterSource`'s default layout.
        cache_dir: where offline builds are saved.
    Raises:
        KeyError: (from :meth:`applied`) a name not in ``sources``.
    """

    def __init__(self, pipe, sources: dict[str, str | IPAdapterSource], cache_dir: Path):
        self.pipe = pipe
        self.sources = dict(sources)
        self.cache_dir = Path(cache_dir)
        self._loaded: dict[str, tuple[dict, Any, Any]] = {}

    def _source(self, name: str) -> IPAdapterSource:
        source = self.sources[name]
        if isinstance(source, IPAdapterSource):
            return source
        if source.startswith(OFFLINE_PREFIX):
            return IPAdapterSource(str(build_offline_ip_adapter(source, self.pipe, self.cache_dir)))
        return IPAdapterSource(source)

    def _load(self, name: str) -> tuple[dict, Any, Any]:
        """The adapter's state dict (``image_proj``, ``ip_adapter``), image encoder (in the UNet's
        dtype and device) and feature extractor, read once."""
        if name not in self._loaded:
            from diffusers.models.model_loading_utils import load_state_dict
            from huggingface_hub import hf_hub_download
            from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

            source = self._source(name)
            root = Path(source.path)
            if root.is_dir():
                weights = root / source.subfolder / source.weight_name
            else:  # a hub id
                weights = Path(hf_hub_download(source.path, source.weight_name, subfolder=source.subfolder or None))
            encoder_dir = _encoder_dir(source)
            flat = load_state_dict(str(weights))
            state: dict[str, dict[str, Any]] = {"image_proj": {}, "ip_adapter": {}}
            for key, value in flat.items():
                part, _, rest = key.partition(".")
                state[part][rest] = value
            unet = self.pipe.unet
            encoder = CLIPVisionModelWithProjection.from_pretrained(encoder_dir).to(unet.device, unet.dtype).eval()
            size = encoder.config.image_size
            self._loaded[name] = (state, encoder, CLIPImageProcessor(size=size, crop_size=size))
        return self._loaded[name]

    def reserved_bytes(self) -> int:
        """Bytes the declared adapters' image encoders hold once loaded (what a worker's batch sizing
        keeps free for them, :func:`pipeline.sizing.addon_bytes`): each CLIP vision tower's parameters
        in the UNet's dtype, a loaded one's as loaded, the others counted from their ``config.json``
        on the ``meta`` device (no weights read). The adapters' own projections are not counted: the
        IP-Adapter paper's has 22M parameters, its OpenCLIP ViT-H/14 image encoder 632M (counted on
        ``meta`` from ViT-H/14's shape: width 1280, MLP 5120, 32 layers, patch 14 at 224², 1024-dim
        projection).

        Raises:
            OSError / ValueError: an encoder's config cannot be read.
        """
        import torch
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        total, itemsize = 0, self.pipe.unet.dtype.itemsize
        for name in self.sources:
            if name in self._loaded:
                encoder = self._loaded[name][1]
                total += sum(p.numel() * p.element_size() for p in encoder.parameters())
                continue
            config = CLIPVisionConfig.from_pretrained(_encoder_dir(self._source(name)))  # builds an offline one
            with torch.device("meta"):
                encoder = CLIPVisionModelWithProjection(config)
            total += sum(p.numel() for p in encoder.parameters()) * itemsize
        return total

    @contextlib.contextmanager
    def applied(self, name: str, scale: float) -> Iterator[Any]:
        """Within the block ``self.pipe`` carries adapter ``name`` at ``scale`` (0 = no effect, 1 = the
        adapter's strength); yields the pipeline. Afterwards the adapter is unloaded and the UNet's
        own attention processors are back, whatever the block raised.

        Raises:
            KeyError: ``name`` is not declared.
        """
        state, encoder, extractor = self._load(name)
        pipe, unet = self.pipe, self.pipe.unet
        own = dict(unet.attn_processors)
        plain_attribute = "encoder_hid_proj" in vars(unet)  # None set in __init__: not a submodule slot
        pipe.register_modules(image_encoder=encoder, feature_extractor=extractor)
        try:
            pipe.load_ip_adapter(state, subfolder="", weight_name="")
            pipe.set_ip_adapter_scale(scale)
            yield pipe
        finally:
            pipe.unload_ip_adapter()
            unet.set_attn_processor(own)
            _restore_plain_attribute(unet, "encoder_hid_proj", plain_attribute)
            pipe.register_modules(image_encoder=None, feature_extractor=None)

    def image_embeds(self, name: str, image: Any, guidance: bool) -> list[Any]:
        """``ip_adapter_image_embeds`` for one call with reference ``image`` (a PIL image): a list
        with one tensor of shape (2 if ``guidance`` else 1, 1, embed dim), the unconditional half
        (zeros, as diffusers makes it) first, in the UNet's dtype.

        One reference per call: diffusers' SD and SDXL pipelines repeat the given embedding over the
        call's batch (``prepare_ip_adapter_image_embeds`` with ``batch_size × num_images_per_prompt``),
        so requests with different references cannot share a call; a batch dimension here would be
        taken as more image tokens for every sample.

        Raises:
            KeyError: ``name`` is not declared.
        """
        import torch

        _, encoder, extractor = self._load(name)
        pixels = extractor(images=[image], return_tensors="pt").pixel_values
        with torch.no_grad():
            embeds = encoder(pixels.to(encoder.device, encoder.dtype)).image_embeds[:, None, :]
        if guidance:
            embeds = torch.cat([torch.zeros_like(embeds), embeds])
        return [embeds]


def _restore_plain_attribute(module, name: str, was_plain: bool) -> None:
    """Put ``name`` back as the plain ``None`` attribute it was before a submodule took its place:
    ``unload_ip_adapter`` sets ``encoder_hid_proj = None`` into the submodule slot the adapter's
    image projection occupied, and TorchDynamo's guards on a compiled UNet, built while it was a
    plain attribute, would then fail for every later call (they ran eagerly on a held worker)."""
    modules = vars(module)["_modules"]
    if was_plain and name in modules and modules[name] is None:
        del modules[name]
        object.__setattr__(module, name, None)


@contextlib.contextmanager
def applied_for_call(adapters: IPAdapters | None, units: Sequence[Any], pipe, kwargs: dict[str, Any],
                     load: Callable[[str], Any] | None) -> Iterator[None]:
    """Around one call of ``pipe`` (the pinned pipeline or one made from it with ``from_pipe``,
    sharing its UNet): the IP-Adapter among the call's control ``units`` (``infra.controls.ControlUnit``;
    none: nothing to do) applied at its ``weight``, and its reference image's embedding (read with
    ``load``) added to ``kwargs`` as ``ip_adapter_image_embeds``, the unconditional half included
    when the call uses classifier-free guidance.

    Raises:
        ValueError: no ``load``.
        KeyError: a unit naming an undeclared adapter.
    """
    unit = next((u for u in units if is_ip_adapter(adapters, u.type)), None)
    if unit is None:
        yield
        return
    if load is None:
        raise ValueError(f"IP-Adapter unit {unit.type!r} needs its image, and this renderer has no input loader")
    adapters = cast(IPAdapters, adapters)
    guidance = kwargs.get("guidance_scale", 1.0) > 1 and getattr(pipe.unet.config, "time_cond_proj_dim", None) is None
    with adapters.applied(unit.type, unit.weight):
        kwargs["ip_adapter_image_embeds"] = adapters.image_embeds(unit.type, load(unit.image), guidance)
        yield


def is_ip_adapter(adapters: IPAdapters | None, unit_type: str) -> bool:
    """Whether a control unit's ``type`` names one of ``adapters`` (else it is a ControlNet)."""
    return adapters is not None and unit_type in adapters.sources


def call_settings(request: Any, adapters: IPAdapters | None) -> tuple:
    """What one call's requests must share beyond the compat key: the ControlNet units' scales and
    ranges (:func:`pipeline.controlnet.control_settings`) and the IP-Adapter unit's reference
    image (diffusers repeats one embedding over the call's batch)."""
    from pipeline.controlnet import control_settings

    return control_settings(request), tuple(u.image for u in request.controls if is_ip_adapter(adapters, u.type))
