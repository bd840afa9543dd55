"""FLOPs per image of each bench row, including the modules another runtime runs.

Place in the data flow: :mod:`bench.pipeline.side_by_side` counts each row once (one eager batch-1
render under ``FlopCounterMode``, :func:`bench.pipeline.render_probes.count_render`) through
:class:`FlopCounts`, and asks it for the row's totals when it writes the rows.

A module compiled to another runtime (OpenVINO's UNet or VAE decoder, ``runtime = "openvino"``)
does the same arithmetic as the PyTorch module it was made from, but the counter cannot see
inside it. Its FLOPs are taken from a row where a module of the same class ran in PyTorch: the
denoiser per call (times this row's denoiser calls), any other module per batch-1 render (the
VAE decoder decodes one image). The row's report names what was filled in that way
(``flops_from_eager``); without such a row the total stays what the counter saw.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.pipeline.render_probes import RenderCount, architecture, count_render, denoiser_class, module_class


def runtime_classes(pipe) -> list[str]:
    """The classes (``source_class``) of ``pipe``'s modules that another runtime runs."""
    found = {module_class(m) for component in pipe.components.values() if isinstance(component, torch.nn.Module)
             for m in component.modules() if getattr(m, "runtime", None)}
    return sorted(found)


class FlopCounts:
    """Counts per architecture, per row: what the counter saw, and the eager FLOPs of each module
    class (per denoiser call, per batch-1 render) to fill what it could not see."""

    def __init__(self, count_flops: bool = True):
        self.count_flops = count_flops
        self.by_architecture: dict[tuple, RenderCount] = {}
        self.rows: dict[str, RenderCount] = {}
        self.hidden: dict[str, list[str]] = {}  # row → classes another runtime ran
        self.denoisers: dict[str, str] = {}  # row → its denoiser's class
        self.per_denoiser_call: dict[str, float] = {}  # denoiser class → FLOPs per call, eager
        self.per_module: dict[str, float] = {}  # module class → FLOPs in a batch-1 render, eager

    def count(self, text: str, pipe, render: Callable[[], object]) -> bool:
        """Count row ``text`` (``render()`` renders one image with its pipeline ``pipe``), once per
        architecture; returns whether a render was counted (False: an equal architecture was)."""
        key = architecture(pipe)
        hidden = runtime_classes(pipe)
        self.hidden[text], self.denoisers[text] = hidden, denoiser_class(pipe)
        counted = key not in self.by_architecture
        if counted:
            self.by_architecture[key] = count_render(pipe, render, flops=self.count_flops)
        count = self.rows[text] = self.by_architecture[key]
        denoiser = self.denoisers[text]
        if count.denoiser_flops > 0 and count.denoiser_calls and denoiser not in hidden:
            self.per_denoiser_call.setdefault(denoiser, count.denoiser_flops / count.denoiser_calls)
        for cls, flops in count.by_module.items():
            if cls not in hidden:
                self.per_module.setdefault(cls, flops)
        return counted

    def totals(self, text: str) -> tuple[float, float, list[str]] | None:
        """Row ``text``'s (FLOPs per image, denoiser FLOPs per image, classes filled from eager
        counts), or None when it was not counted."""
        count = self.rows.get(text)
        if count is None:
            return None
        flops, denoiser_flops, filled = count.flops, count.denoiser_flops, []
        denoiser = self.denoisers[text]
        for cls in self.hidden[text]:
            if cls == denoiser and count.denoiser_calls and cls in self.per_denoiser_call:
                denoiser_flops = self.per_denoiser_call[cls] * count.denoiser_calls
                flops += denoiser_flops
                filled.append(cls)
            elif cls != denoiser and cls not in count.by_module and cls in self.per_module:
                flops += self.per_module[cls]
                filled.append(cls)
        return flops, denoiser_flops, filled
