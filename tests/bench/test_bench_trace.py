"""Reading a profiler trace (bench/pipeline/trace.py) on a trace in Kineto's Chrome format with
CUDA activity, as ``torch.profiler`` writes it on a GPU: API calls on the host thread carry
correlation ids, kernels and copies on the device carry the same ids. (The CPU format is checked
end to end by ``bench profile`` in test_bench_profile.py.)"""

from __future__ import annotations

import pytest

from bench.pipeline.render_probes import StepMarks
from bench.pipeline.trace import CATEGORIES, analyze, category

RANGES = (StepMarks.STEP, StepMarks.DENOISER, StepMarks.SCHEDULER_STEP)
HOST, STREAM = 11, 7


def _x(cat, name, ts, dur, tid=HOST, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": float(ts), "dur": float(dur), "args": {}}
    if corr is not None:
        event["args"]["correlation"] = corr
    return event


def _launch(name, ts, corr, kernels, api="cudaLaunchKernel", cat="cuda_runtime"):
    """One API call at ``ts`` and what it ran on the device (name, duration µs)."""
    events = [_x(cat, api, ts, 4, corr=corr)]
    t = 5000 + ts * 2
    for kernel, dur in kernels:
        events.append(_x("kernel" if not kernel.startswith("Memcpy") else "gpu_memcpy", kernel, t, dur,
                         tid=STREAM, corr=corr))
        t += dur
    return events


def _trace():
    ev = [
        _x("user_annotation", StepMarks.STEP, 0, 1000), _x("user_annotation", StepMarks.DENOISER, 10, 590),
        _x("user_annotation", StepMarks.SCHEDULER_STEP, 700, 100),
        _x("cpu_op", "aten::linear", 20, 30), _x("cpu_op", "aten::addmm", 22, 20),  # nested: 1 top-level op
        _x("cpu_op", "aten::add", 710, 10),
        _x("user_annotation", StepMarks.STEP, 1000, 1000), _x("user_annotation", StepMarks.DENOISER, 1010, 500),
        _x("user_annotation", StepMarks.SCHEDULER_STEP, 1600, 100),
    ]
    # step 1: denoiser launches a GEMM, flash attention, a fused group norm and (driver API) a Triton kernel
    ev += _launch("gemm", 20, 1, [("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 300)])
    ev += _launch("attn", 100, 2, [("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 200)])
    ev += _launch("norm", 200, 3, [("triton_red_fused_native_group_norm_0", 50)])
    ev += _launch("ew", 300, 4, [("triton_poi_fused_add_mul_1", 25)], api="cuLaunchKernel", cat="cuda_driver")
    # step 1's scheduler.step: one elementwise kernel, then a .item(): D2H copy + stream sync
    ev += _launch("sched", 710, 5, [("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", 10)])
    ev += _launch("copy", 730, 6, [("Memcpy DtoH (Device -> Pageable)", 2)], api="cudaMemcpyAsync")
    ev.append(_x("cuda_runtime", "cudaStreamSynchronize", 740, 30, corr=7))
    # step 2: the denoiser is one CUDA graph replay of two kernels; scheduler.step launches one kernel
    ev += _launch("graph", 1020, 8, [("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwc", 400),
                                     ("triton_poi_fused_convolution_2", 40)], api="cudaGraphLaunch")
    ev += _launch("sched2", 1610, 9, [("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", 10)])
    # after the loop: the VAE decode, outside every range
    ev += _launch("vae", 2500, 10, [("cudnn::implicit_convolve_sgemm", 1000)])
    return ev


def test_counts_per_step_per_denoiser_call_and_per_scheduler_step():
    r = analyze(_trace(), RANGES)
    assert r["timeline"] == "cuda" and r["steps"] == 2 and r["denoiser_calls"] == 2
    assert r["per_denoiser_call"]["launches"] == 2.5  # 4 launches, then 1 graph launch
    assert r["per_denoiser_call"]["kernels"] == 3.0  # 4 kernels, then 2 kernels from the graph
    assert r["per_scheduler_step"]["launches"] == 1.0
    assert r["per_scheduler_step"]["syncs"] == 0.5 and r["per_scheduler_step"]["d2h_copies"] == 0.5
    assert r["per_step"]["launches"] == 3.5 and r["per_step"]["syncs"] == 0.5
    assert r["per_step"]["cpu_ops"] == 1.0  # step 1: linear (addmm inside it) and add; step 2: none


def test_time_by_category_and_the_denoisers_device_time():
    r = analyze(_trace(), RANGES)
    render, denoiser = r["time_by_category"]["render"], r["time_by_category"]["denoiser"]
    assert list(render) == list(CATEGORIES)
    assert render["gemm"] == pytest.approx((300 + 400 + 1000) / 1000)
    assert render["attention"] == pytest.approx(0.2) and render["norm"] == pytest.approx(0.05)
    assert render["elementwise/other"] == pytest.approx((25 + 10 + 2 + 40 + 10) / 1000)
    assert denoiser["gemm"] == pytest.approx(0.7) and denoiser["elementwise/other"] == pytest.approx(0.065)
    assert r["denoiser"]["busy_ms_per_call"] == pytest.approx((0.575 + 0.44) / 2, abs=0.005)  # 2 decimals
    assert r["denoiser"]["ms_per_call"] >= r["denoiser"]["busy_ms_per_call"]


@pytest.mark.parametrize("name, expected", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_tn_align8>", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    ("flash_fwd_kernel", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::Half>", "norm"),
    ("triton_poi_fused_convolution_0", "elementwise/other"),  # Inductor's bias add after an extern conv
    ("Memcpy HtoD (Pageable -> Device)", "elementwise/other"),
    ("aten::mkldnn_convolution", "gemm"), ("aten::addmm", "gemm"), ("aten::native_group_norm", "norm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::silu", "elementwise/other"),
])
def test_kernel_and_op_categories(name, expected):
    assert category(name) == expected
