"""AOTInductor packages of a frozen module (pipeline/optimize/aot.py): compiled once per shape,
loaded by the next worker without compiling, carried by the compile cache, and never a failed
render (a shape outside the warm-up, a forced-eager measurement or a broken package runs eagerly).

One small convolutional module stands in for the VAE decoder (the same ops: convolution, group
norm, SiLU, upsampling): a package costs one Inductor compile and one C++ build of its wrapper,
so the module compiles once here, in a cache directory of this file's own.
"""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from pipeline import compile_count
from pipeline.compile_cache import AOT_PACKAGES, CacheKey, export_artifacts, import_artifacts, unpack
from pipeline.optimize.aot import AotForward, install
from pipeline.optimize.compile import has_cpp_compiler

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="AOTInductor needs a C++ compiler")


class Decoderish(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 8)
        self.conv_out = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.silu(self.norm(self.conv_in(sample)))
        return self.conv_out(torch.nn.functional.interpolate(hidden, scale_factor=2.0, mode="nearest"))


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Decoderish().eval()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One package compiled at batch 2, 8×8 latents, in this module's own Inductor cache directory;
    yields ``(cache directory, sample, eager output, the AotForward that compiled it)``."""
    root = tmp_path_factory.mktemp("aot-inductor")
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    compile_count.release_compiled()
    module = _module()
    sample = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module(sample)
        forward = install(module, "toy")
        before = compile_count.aot_packages()
        got = module(sample)
    after = compile_count.aot_packages()
    assert after["compiled"] == before["compiled"] + 1 and after["loaded"] == before["loaded"]
    assert torch.allclose(got, expected, atol=1e-5)
    yield root, sample, expected, forward
    patch.undo()


def test_a_package_compiles_once_and_the_next_worker_loads_it(compiled) -> None:
    root, sample, expected, first = compiled
    packages = list((root / AOT_PACKAGES).glob("toy-*.pt2"))
    assert [p.name for p in packages] == [first.package_path(sample).name]
    assert first.report == {"shapes": [[2, 4, 8, 8]], "failed": {}}
    # a second worker: same weights, a new module object; it loads the package, compiling nothing
    module = _module()
    install(module, "toy")
    compiles, before = compile_count.compiles(), compile_count.aot_packages()
    with torch.no_grad():
        got = module(sample)
    assert compile_count.aot_packages() == {**before, "loaded": before["loaded"] + 1}
    assert compile_count.compiles() == compiles + 1  # one graph for the shape, as a cache-served dynamo compile
    assert torch.allclose(got, expected, atol=1e-5)


def test_other_weights_or_shapes_are_other_packages(compiled) -> None:
    _, sample, _, first = compiled
    other = AotForward(_module(seed=1), "toy")  # a fine-tune: same class and shape, other weights
    assert other.package_path(sample) != first.package_path(sample)
    assert first.package_path(sample[:1]) != first.package_path(sample)
    assert first.package_path(sample.to(torch.bfloat16)) != first.package_path(sample)


def test_after_the_warm_up_a_new_shape_runs_eagerly_and_compiles_nothing(compiled) -> None:
    _, sample, expected, _ = compiled
    module = _module()
    forward = install(module, "toy")
    odd = torch.randn(3, 4, 8, 8)
    with torch.no_grad():
        module(sample)  # the warm-up: the package of this shape is loaded
    compiles = compile_count.compiles()
    try:
        compile_count.hold_compiled()
        with torch.no_grad():
            held = module(odd)
            warmed = module(sample)  # a warmed shape still runs its package
        with compile_count.eager(), torch.no_grad():  # e.g. the memory measurement before warm-up
            module(torch.randn(1, 4, 16, 16))
        late = _module()
        install(late, "toy")
        with torch.no_grad():  # held: even a package on disk is not loaded in the hot path
            late(sample)
    finally:
        compile_count.release_compiled()
    assert compile_count.compiles() == compiles
    assert forward.report["shapes"] == [[2, 4, 8, 8]] and late.forward.report["shapes"] == []
    assert torch.allclose(warmed, expected, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(held, type(module).forward(module, odd))


def test_every_call_is_counted_by_what_ran_and_fail_on_recompile_refuses_a_new_shape(compiled) -> None:
    """A package that ran is a compiled call, the module's own forward in its place an eager one;
    under fail_on_recompile a shape without a loaded package raises (as TorchDynamo does) instead
    of running eagerly, and is not remembered as failed."""
    _, sample, expected, _ = compiled
    module = _module()
    forward = install(module, "toy")
    odd = torch.randn(3, 4, 8, 8)
    with torch.no_grad(), compile_count.observed() as warm:
        module(sample)  # the warm-up: loaded, then run
    assert warm == compile_count.CallCounts(compiled=1)
    try:
        compile_count.hold_compiled()
        with torch.no_grad(), compile_count.observed() as held:
            module(sample)
            module(odd)
        with compile_count.fail_on_recompile(), torch.no_grad():
            served = module(sample)
            with pytest.raises(RuntimeError, match="no package loaded for toy at 3x4x8x8 float32"):
                module(odd)
        with compile_count.eager(), torch.no_grad(), compile_count.observed() as forced:
            module(sample)
    finally:
        compile_count.release_compiled()
    assert held == compile_count.CallCounts(compiled=1, eager=1)
    assert forced == compile_count.CallCounts(eager=1)
    assert torch.allclose(served, expected, atol=1e-5) and forward.report["failed"] == {}


def test_a_broken_package_runs_eagerly_with_the_reason(compiled, caplog) -> None:
    root, sample, expected, _ = compiled
    module = _module()
    forward = install(module, "toy")
    path = forward.package_path(sample)
    good = path.read_bytes()
    half = sample.to(torch.bfloat16)
    other = forward.package_path(half)  # the same shape in bfloat16: another package, broken too
    try:
        path.write_bytes(b"not a package")
        other.write_bytes(b"not a package either")
        with torch.no_grad(), caplog.at_level("WARNING", logger="renderfarm.worker"):
            got = module(sample)
            module(sample)  # the failure is remembered: no second attempt
            module.to(torch.bfloat16)
            got_half = module(half)  # a failure at float32 does not decide bfloat16: its own attempt
            module(half)
    finally:
        path.write_bytes(good)
        other.unlink()
    assert torch.allclose(got, expected, atol=1e-6)
    assert got_half.dtype == torch.bfloat16 and got_half.shape == expected.shape
    assert sorted(forward.report["failed"]) == ["2x4x8x8 bfloat16", "2x4x8x8 float32"]
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 2


def test_the_compile_cache_carries_packages_without_their_build_copies(compiled) -> None:
    root, sample, _, first = compiled
    key = CacheKey({"model": "toy"})
    blob = export_artifacts(key)
    assert blob is not None
    with tarfile.open(fileobj=io.BytesIO(unpack(blob, key))) as tar:
        names = tar.getnames()
    package = f"kernels/{AOT_PACKAGES}/{first.package_path(sample).name}"
    assert package in names and "megacache.bin" in names
    assert not [n for n in names if n.endswith(".wrapper.so")]  # the package carries the model library
    path = first.package_path(sample)
    data = path.read_bytes()
    path.unlink()
    outcome = import_artifacts(blob, key)
    assert outcome.outcome == "hit", outcome.reason
    assert path.read_bytes() == data
