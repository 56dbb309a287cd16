"""What kernel names say: fused attention, communication, fp32 GEMMs, and each kernel's share of time.

Only the name is used, so these are name heuristics, and the metrics say so in their sources.
The patterns cover the kernels that PyTorch on ROCm and CUDA actually launches: Composable Kernel
and Triton flash attention, hipBLASLt/Tensile and cuBLAS GEMMs, RCCL/NCCL collectives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from runner.metrics import KernelShare

Category = Literal["comm", "precision", "shape", "useful"]

# Fused attention: CK's fmha, flash-attention (ROCm and CUDA builds), aotriton/Triton kernels,
# PyTorch's memory-efficient and flash SDPA back-ends.
_ATTENTION = re.compile(
    r"flash_?attn|flash_?attention|flash_fwd|flash_bwd|fmha|attn_fwd|attn_bwd|efficient_attention"
    r"|mha_fwd|mha_bwd|paged_attention|attention_kernel|attention_fwd|attention_bwd|native_sdpa|_sdpa_",
    re.IGNORECASE,
)
# PyTorch operators (the torch.profiler CPU path): `aten::scaled_dot_product_attention` is the
# dispatcher and shows up whatever runs underneath; only the fused back-ends count, never
# `aten::_scaled_dot_product_attention_math` (the unfused GEMM + softmax path).
_ATEN_ATTENTION = re.compile(
    r"^aten::_(?:scaled_dot_product_(?:flash|efficient|cudnn|fused)_attention|flash_attention_|efficient_attention_)"
)

_COMM = re.compile(
    r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|c10d::|broadcast_kernel", re.IGNORECASE
)

# fp32 (or fp64) GEMMs: Tensile/hipBLASLt names carry the data type after the layout
# ("Cijk_Ailk_Bljk_SB_..." is single precision, "..._BBS_BH_..." is bf16), cuBLAS/rocBLAS name
# single-precision kernels "sgemm".
_FP32_GEMM = re.compile(
    r"sgemm|dgemm|Cijk_A[a-z]+_B[a-z]+_(?:S|D|SB|DB|SS|DD|SSS)_|gemm\w*_f32f32|gemm_fp32", re.IGNORECASE
)

# A kernel averaging less than this is launch-bound: a shape too small to fill the GPU.
TINY_KERNEL_NS = 10_000


def is_attention_kernel(name: str) -> bool:
    """True when the name is a fused attention kernel (flash, CK fmha, efficient SDPA, Triton attn)."""
    if name.startswith("aten::"):
        return bool(_ATEN_ATTENTION.match(name))
    return bool(_ATTENTION.search(name))


def classify(name: str, calls: int, total_ns: float) -> Category:
    """The waste-budget bucket a kernel's time goes to; first match wins: comm, precision, shape."""
    if _COMM.search(name):
        return "comm"
    if _FP32_GEMM.search(name):
        return "precision"
    if calls > 0 and total_ns / calls < TINY_KERNEL_NS:
        return "shape"
    return "useful"


def kernel_shares(totals: Mapping[str, tuple[int, float]], top_n: int = 10) -> tuple[list[KernelShare], float]:
    """The `top_n` kernels by time with their percentage of all kernel time, and the rest's share.

    `totals` maps a kernel name to (calls, total nanoseconds). The returned percentages and the
    remainder add up to 100 whenever any kernel time was recorded.
    """
    grand = float(sum(ns for _, ns in totals.values() if ns > 0))
    if grand <= 0:
        return [], 0.0
    ranked = sorted(((ns, name, calls) for name, (calls, ns) in totals.items() if ns > 0), key=lambda t: (-t[0], t[1]))
    top = [
        KernelShare(name=name, pct_time=100.0 * ns / grand, calls=calls, total_ms=ns / 1e6)
        for ns, name, calls in ranked[:top_n]
    ]
    rest = sum(ns for ns, _, _ in ranked[top_n:])
    return top, 100.0 * rest / grand


def attention_evidence(names: list[str], limit: int = 5) -> tuple[bool | None, list[str]]:
    """Whether any fused attention kernel ran, and up to `limit` of their names; None without kernels."""
    if not names:
        return None, []
    found = [name for name in names if is_attention_kernel(name)]
    return bool(found), found[:limit]
