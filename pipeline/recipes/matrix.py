"""``python -m pipeline.recipes.matrix``: the recipe each fake device profile gets, per model family.

Place in the data flow: documentation only; it calls :func:`pipeline.recipes.select_recipe` with
the fake probes the tests use (H100 80 GB, L4 24 GB, T4 16 GB, an 8 GB Ampere card) and prints a
Markdown table of the knobs that differ between families.
"""

from __future__ import annotations

from pipeline.device import GB, DeviceProfile
from pipeline.models.families import FAMILY_SPECS
from pipeline.recipes import select_recipe

PROFILES = {
    "H100 80GB sm90": DeviceProfile(kind="cuda", name="H100", compute_capability=(9, 0), total_memory_bytes=80 * GB,
                                    cpu_cores=16, flash_attn_available=True),
    "L4 24GB sm89": DeviceProfile(kind="cuda", name="L4", compute_capability=(8, 9), total_memory_bytes=24 * GB),
    "T4 16GB sm75": DeviceProfile(kind="cuda", name="T4", compute_capability=(7, 5), total_memory_bytes=16 * GB),
    "8GB sm86": DeviceProfile(kind="cuda", name="RTX 3070", compute_capability=(8, 6), total_memory_bytes=8 * GB),
}


def rows(allow_approximate: bool) -> list[list[str]]:
    """One row per (profile, family).

    Columns: recipe, dtype, attention, compile, QKV, layout, quantization, tiny VAE, offload, batch.
    """
    out = []
    for label, profile in PROFILES.items():
        for family in FAMILY_SPECS:
            r = select_recipe(profile, allow_approximate, family=family)
            compile_ = ("regional" if r.compile_regional else "full") + (", dynamic" if r.compile_dynamic else "") \
                if r.compile_denoiser else "-"
            out.append([label, family, r.name, r.dtype, r.attention, compile_, "yes" if r.fuse_qkv else "-",
                        "yes" if r.channels_last else "-", r.quantization or "-", r.tiny_vae or "-",
                        "yes" if r.cpu_offload else "-", str(r.max_batch_size),
                        "yes" if r.batch_invariant else "-", ", ".join(r.approximations()) or "-"])
    return out


def main() -> None:
    header = ["device", "family", "recipe", "dtype", "attention", "compile", "fused QKV", "channels_last",
              "quantization", "tiny VAE", "offload", "max batch", "CPU invariant kernels", "approximations"]
    for flavour in (False, True):
        print(f"\n### {'fast' if flavour else 'exact'}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows(flavour):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
