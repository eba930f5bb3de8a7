"""benchmarks/trainer.py's profile shares count kernels, not the ranges around them: inductor's
"## Call CompiledFxGraph ##" annotations span the kernels they launch on the GPU timeline,
and counting them once more read a compiled 1.66 s step as 2.99 s of GPU time, half of it
"other" (an H200 profile, whose kernel names these are)."""

from __future__ import annotations

import pytest

from benchmarks.trainer import ANNOTATION, kernel_shares

# (name, µs, calls): part of one compiled fixed-4k step on the H200.
STEP = [
    ("## Call CompiledFxGraph fykc5f6oxkuigx7gtmh2wkwndtk7cga56qgrkggqlkhwzyx6dgnf ##", 850_370.0, 112),
    ("## Call CompiledFxGraph fbpuygny7hcfxpkynmjfb2533rdhrpxiwkuulffnjkxewix7u7ag ##", 409_870.0, 112),
    ("ProfilerStep#1", 1_700_000.0, 1),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128", 235_050.0, 112),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 158_730.0, 672),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", 37_750.0, 112),
    ("void at::native::elementwise_kernel<128, 4, copy_>", 20_000.0, 50),
    ("void at::native::multi_tensor_apply_kernel<FusedAdam>", 10_000.0, 1),
]


def test_annotations_are_ranges_not_kernels() -> None:
    names = [n for n, _, _ in STEP]
    assert [bool(ANNOTATION.match(n)) for n in names] == [True, True, True, False, False, False, False, False]


def test_shares_count_each_kernel_once() -> None:
    kernels = [k for k in STEP if not ANNOTATION.match(k[0])]
    total, share = kernel_shares(kernels)
    assert total == pytest.approx(235_050 + 158_730 + 37_750 + 20_000 + 10_000)
    assert share == {
        "attention": round(235_050 / total, 4),
        "gemm": round(158_730 / total, 4),
        "other": round(37_750 / total, 4),
        "copy/cast": round(20_000 / total, 4),
        "optimizer": round(10_000 / total, 4),
    }
    assert list(share) == sorted(share, key=lambda k: -share[k])  # largest first
