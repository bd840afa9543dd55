"""No host-device synchronization inside the denoising loop, for every scheduler a request may name.

Place in the data flow: :class:`pipeline.render.Renderer` calls :func:`make_sync_free` on the
scheduler of each group before the pipeline call; :func:`install_pinned_noise` is installed once.

Why: on CUDA, a synchronization makes the host wait until every queued kernel has run, so the
CPU cannot run ahead of the GPU (the ERNIE-ViLG 2.0 inference article: "pre-computed parameters
remove CPU work and GPU-CPU synchronization during sampling loops"). Sources in diffusers' loops,
and what removes them, all exact (same values, same arithmetic):

* ``index_for_timestep``: the first ``step`` of most schedulers looks its position up with
  ``(timesteps == t).nonzero()`` and ``.item()``. Text-to-image always starts at index 0, so
  ``set_begin_index(0)`` right after ``set_timesteps`` removes the lookup.
* ``alphas_cumprod[t]`` with a device ``t`` (DDIM, PNDM) and Euler's sigma tables: the
  precomputed twins of :mod:`pipeline.scheduling`.
* Noise drawn inside the loop (ancestral / SDE samplers) from the CPU generators the farm uses
  for cross-device reproducibility: ``randn_tensor`` copies it to the device with a blocking copy.
  :func:`install_pinned_noise` draws the same numbers from the same generators, then copies from
  pinned memory with ``non_blocking=True`` (no synchronization; the caching host allocator keeps
  the buffer alive until the copy is done).
* ERNIE-Image's loop calls ``t.item()`` on every step: its scheduler keeps ``timesteps`` on the
  host (``host_timesteps``), where ``.item()`` is free; its sigmas stay on the device.

:class:`SyncSpy` is the check that runs without CUDA: the loop runs on the ``meta`` device (a
stand-in for an accelerator: no data, every cross-device copy visible) and every operation that
would synchronize on CUDA is recorded. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is
the proof (``tests/unit/pipeline/test_sync_free.py``, ``bench.pipeline.gpu_checks``).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_MARK = "_renderfarm_sync_free"


#: Scheduler class → what else its loop needs. UniPC copies a host sigma to the device on every
#: step (``self.sigmas[i].to(device)``): its sigmas go to the device once. LCM indexes its host
#: ``alphas_cumprod`` with the timestep and compares it (``prev_timestep >= 0``): its timesteps stay
#: on the host, where that is free, and the denoiser gets them by :func:`install_timestep_hook`.
POLICIES: dict[str, dict[str, bool]] = {
    "UniPCMultistepScheduler": {"device_sigmas": True},
    "LCMScheduler": {"host_timesteps": True},
}


def make_sync_free(scheduler, host_timesteps: bool = False):
    """Wrap ``scheduler.set_timesteps`` (once per instance and setting) so that the loop starts at
    index 0 without a lookup; keep ``timesteps`` on the host when ``host_timesteps`` (or the
    class's :data:`POLICIES` say so), and sigmas on the device where the policy says. Returns it."""
    policy = POLICIES.get(type(scheduler).__name__, {})
    host_timesteps = host_timesteps or policy.get("host_timesteps", False)
    if getattr(scheduler, _MARK, None) == host_timesteps:
        return scheduler
    original = getattr(scheduler, "_renderfarm_set_timesteps", None) or scheduler.set_timesteps

    @functools.wraps(original)
    def set_timesteps(*args, **kwargs):
        out = original(*args, **kwargs)
        if hasattr(scheduler, "set_begin_index") and getattr(scheduler, "begin_index", None) is None:
            scheduler.set_begin_index(0)
        device = scheduler.timesteps.device if isinstance(scheduler.timesteps, torch.Tensor) else None
        if policy.get("device_sigmas") and device is not None and isinstance(getattr(scheduler, "sigmas", None),
                                                                             torch.Tensor):
            scheduler.sigmas = scheduler.sigmas.to(device)
        if host_timesteps and device is not None:
            scheduler.timesteps = scheduler.timesteps.cpu()  # before the loop: one copy, not one per step
        return out

    object.__setattr__(scheduler, "_renderfarm_set_timesteps", original)
    object.__setattr__(scheduler, "set_timesteps", set_timesteps)
    object.__setattr__(scheduler, _MARK, host_timesteps)
    return scheduler


def _timesteps_to_device(module, args, kwargs):
    """Forward pre-hook: small host tensors (timesteps) go to the module's device without blocking."""
    param = next(module.parameters(), None)
    device = param.device if param is not None else getattr(module, "device", torch.device("cpu"))
    if device.type == "cpu":
        return None

    def move(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() <= 4096:
            return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)
        return x

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def install_timestep_hook(denoiser) -> None:
    """Let ``denoiser`` take host timesteps: copied from pinned memory, non-blocking (idempotent)."""
    if not getattr(denoiser, "_renderfarm_timestep_hook", False):
        denoiser.register_forward_pre_hook(_timesteps_to_device, with_kwargs=True)
        denoiser._renderfarm_timestep_hook = True


# ---- noise -----------------------------------------------------------------------------------

def _pinned_randn_tensor(original, shape, generator=None, device=None, dtype=None, layout=None, **kwargs):
    target = torch.device(device) if device is not None else None
    first = generator[0] if isinstance(generator, list) and generator else generator
    if target is not None and target.type in ("cuda", "meta") and first is not None and first.device.type == "cpu":
        noise = original(shape, generator=generator, device=torch.device("cpu"), dtype=dtype, layout=layout, **kwargs)
        if target.type == "cuda":
            noise = noise.pin_memory()
        return noise.to(target, non_blocking=True)
    return original(shape, generator=generator, device=device, dtype=dtype, layout=layout, **kwargs)


def install_pinned_noise() -> int:
    """Route every loaded diffusers module's ``randn_tensor`` through pinned, non-blocking copies
    (same numbers). Idempotent; returns how many modules were patched by this call."""
    from diffusers.utils import torch_utils

    original = getattr(torch_utils, "_renderfarm_original_randn", None) or torch_utils.randn_tensor
    torch_utils._renderfarm_original_randn = original
    patched = functools.partial(_pinned_randn_tensor, original)
    count = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("diffusers.") and getattr(module, "randn_tensor", None) is original:
            module.randn_tensor = patched  # type: ignore[attr-defined]  # patching a diffusers module
            count += 1
    return count


# ---- the CPU-side check ----------------------------------------------------------------------

_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
             "aten.equal.default"}


class SyncSpy:
    """Records what would synchronize host and device, for code running on ``meta`` tensors.

    Recorded: scalar reads (``.item()``, ``bool(t)``), ``nonzero``, blocking copies between the
    host and the device, tensors made from host data on the device (``torch.tensor(x,
    device=...)``). Use as a context manager; ``events`` lists them (op and shapes).
    """

    def __init__(self, device: str = "meta"):
        self.device = device
        self.events: list[str] = []
        self._modes = (_FunctionSpy(self), _DispatchSpy(self))

    def __enter__(self) -> "SyncSpy":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _FunctionSpy(TorchFunctionMode):
    def __init__(self, spy: SyncSpy):
        super().__init__()
        self.spy = spy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None \
                and torch.device(device).type == self.spy.device and not isinstance(args[0], torch.Tensor):
            self.spy.events.append(f"{func.__name__}(host data, device={device})")
        return func(*args, **kwargs)


class _DispatchSpy(TorchDispatchMode):
    def __init__(self, spy: SyncSpy):
        super().__init__()
        self.spy = spy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if name in _SYNC_OPS and self.spy.device in devices:
            self.spy.events.append(f"{name} {[tuple(t.shape) for t in tensors]}")
            if name == "aten._local_scalar_dense.default":  # keep going with stand-in values: record every one
                return torch.zeros((), dtype=tensors[0].dtype).item()
            if name == "aten.nonzero.default":
                return torch.zeros((1, tensors[0].dim()), dtype=torch.long, device=tensors[0].device)
        elif name in ("aten._to_copy.default", "aten.copy_.default") and not kwargs.get("non_blocking", False):
            target = kwargs.get("device")
            src = tensors[-1].device.type if tensors else None
            dst = torch.device(target).type if target is not None else (tensors[0].device.type if
                                                                          name == "aten.copy_.default" else src)
            if {src, dst} == {"cpu", self.spy.device}:
                self.spy.events.append(f"{name} {src}->{dst} {tuple(tensors[-1].shape)}")
        return func(*args, **kwargs)


def spy_scheduler_loop(scheduler, steps: int = 4, host_timesteps: bool = False, batch: int = 2,
                       channels: int = 4) -> list[str]:
    """Run ``scheduler``'s denoising loop the way the pipelines drive it, on ``meta`` tensors with a
    stand-in denoiser, and return what would synchronize on CUDA (empty = nothing).

    ``set_timesteps`` runs with ``device="meta"``; schedulers that read their own device tensors
    back while setting up (DDIM, PNDM, Euler's twins) are set up on the host and their device-side
    tables moved to ``meta``, as ``set_timesteps(device=...)`` would place them. Noise comes from
    CPU generators through :func:`install_pinned_noise`, as in the farm.
    """
    install_pinned_noise()
    make_sync_free(scheduler, host_timesteps)
    host = getattr(scheduler, _MARK)
    try:
        scheduler.set_timesteps(steps, device="meta")
    except NotImplementedError:  # "Cannot copy out of meta tensor": this setup reads its tables back
        scheduler.set_timesteps(steps, device="cpu")
        if not host:
            scheduler.timesteps = scheduler.timesteps.to("meta")
        if getattr(scheduler, "_pc_tables", None):
            scheduler._pc_tables = {k: v.to("meta") for k, v in scheduler._pc_tables.items()}
    import inspect

    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    extra = {"generator": generators} if "generator" in inspect.signature(scheduler.step).parameters else {}
    x = torch.zeros(batch, channels, 8, 8, device="meta")
    with SyncSpy() as spy:
        for t in scheduler.timesteps:
            if host:  # the pipeline reads t on the host (ERNIE-Image's t.item(), LCM's comparisons)
                float(t.item())
            model_in = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x
            x = scheduler.step(model_in * 0.5, t, x, return_dict=False, **extra)[0]
    return spy.events
