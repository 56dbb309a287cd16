"""Kernel-name heuristics and the hardware tables behind MFU."""

from __future__ import annotations

import pytest

from runner.hardware import flops_per_token, mfu_pct, peak_from_name
from runner.kernels import attention_evidence, classify, is_attention_kernel


@pytest.mark.parametrize(
    "name",
    [
        "void ck_tile::kentry<128, 1, ck_tile::FmhaFwdKernel<...>>(FmhaFwdBatchModeKargs)",  # CK on ROCm
        "attn_fwd",  # aotriton / Triton
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(...)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_flash_attention_forward",
    ],
)
def test_fused_attention_kernels_are_recognised(name):
    assert is_attention_kernel(name)


@pytest.mark.parametrize(
    "name",
    [
        "aten::scaled_dot_product_attention",  # the dispatcher: present whatever runs underneath
        "aten::_scaled_dot_product_attention_math",
        "aten::_softmax",
        "Cijk_Ailk_Bjlk_BBS_BH_MT128x128x32_MI32x32x8_SN_ISA942",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float>(...)",
    ],
)
def test_unfused_attention_and_other_kernels_are_not(name):
    assert not is_attention_kernel(name)


def test_no_kernels_means_attention_unknown_not_false():
    assert attention_evidence([]) == (None, [])
    assert attention_evidence(["aten::mm"]) == (False, [])


def test_kernels_go_to_one_bucket_each_in_order_comm_precision_shape_useful():
    assert classify("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", 1, 5_000) == "comm"
    assert classify("Cijk_Ailk_Bljk_SB_MT64x64x8_SN_ISA942", 10, 1_000_000) == "precision"
    assert classify("ampere_sgemm_128x64_nn", 10, 1_000_000) == "precision"
    assert classify("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x256x64", 10, 1_000_000) == "useful"
    assert classify("void at::native::vectorized_elementwise_kernel<4>", 100, 300_000) == "shape"


def tflops(name: str) -> float | None:
    peak = peak_from_name(name)
    return None if peak is None else peak.tflops


def test_published_peaks_and_the_flops_convention():
    assert tflops("AMD Instinct MI300X") == 1307.4
    assert tflops("NVIDIA H100 PCIe") == 756.0
    assert tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_from_name("Intel Arc") is None
    assert flops_per_token(1e9) == 6e9  # full fine-tuning: 6N
    assert flops_per_token(1e9, 1e7) == 4e9 + 2e7  # LoRA: the frozen weights get no weight gradient
    assert mfu_pct(1000.0, 6e9, 1000.0, 1) == pytest.approx(0.6)
    assert mfu_pct(None, 6e9, 1000.0, 1) is None
