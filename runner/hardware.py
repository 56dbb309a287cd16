"""GPU peak FLOPs and model FLOPs per token: the two halves of MFU.

The peak is dense bf16 matrix throughput. On AMD it is computed from `agent_info.csv` as
compute units x peak engine clock x bf16 FLOPs per clock per CU of the ISA, so a part with fewer
CUs or a lower clock gets its own peak; failing that, a product name is looked up in a table of
published figures. Model FLOPs per token follow the usual convention: 2N for the forward pass,
2N for the backward pass through the activations and 2 x trainable parameters for the weight
gradients (6N for full fine-tuning, less for LoRA); recomputation is not counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Dense bf16 FLOPs per clock per compute unit (matrix cores), by ISA.
BF16_FLOPS_PER_CLOCK_PER_CU = {
    "gfx908": 512,  # MI100
    "gfx90a": 1024,  # MI210, MI250, MI250X
    "gfx940": 2048,
    "gfx941": 2048,
    "gfx942": 2048,  # MI300A, MI300X, MI325X
    "gfx950": 4096,  # MI350X, MI355X
}

# Published dense bf16 peaks (TFLOPs) for when agent_info.csv is not there; most specific first.
PRODUCT_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("MI355X", 2516.6),
    ("MI350X", 2306.9),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
    ("MI300A", 980.6),
    ("MI250X", 383.0),
    ("MI250", 362.1),
    ("MI210", 181.0),
    ("MI100", 92.3),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("RTX 4090", 165.2),
)


def gfx_name(target_version: int | None) -> str | None:
    """`Gfx_Target_Version` as the ISA name: 90402 -> "gfx942", 90010 -> "gfx90a"."""
    if not target_version or target_version < 10000:
        return None
    major, minor, step = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor}{step:x}"


@dataclass
class Peak:
    tflops: float
    source: str


def peak_from_agent(
    isa: str | None, cu_count: int | None, clock_mhz: float | None, where: str = "agent_info.csv"
) -> Peak | None:
    """Dense bf16 peak from the agent's compute units and peak clock, for ISAs in the table; `where` they were read."""
    if not isa or not cu_count or not clock_mhz:
        return None
    per_clock = BF16_FLOPS_PER_CLOCK_PER_CU.get(isa.lower())
    if per_clock is None:
        return None
    tflops = cu_count * clock_mhz * 1e6 * per_clock / 1e12
    return Peak(
        tflops,
        f"{where}: {cu_count} CUs x {clock_mhz:.0f} MHz x {per_clock} bf16 FLOP/clock/CU ({isa}) = {tflops:.1f} TFLOPs",
    )


def peak_from_name(name: str | None) -> Peak | None:
    """Published dense bf16 peak for a product name such as "AMD Instinct MI300X"."""
    if not name:
        return None
    for product, tflops in PRODUCT_PEAK_TFLOPS:
        if re.search(re.escape(product), name, re.IGNORECASE):
            return Peak(tflops, f"published dense bf16 peak of {product} ({tflops} TFLOPs), matched from {name!r}")
    return None


def flops_per_token(params: float | None, trainable: float | None = None) -> float | None:
    """Training FLOPs per token: 4N + 2 x trainable (6N when every parameter trains)."""
    if not params or params <= 0:
        return None
    if trainable is None or trainable < 0 or trainable > params:
        trainable = params
    return 4.0 * params + 2.0 * trainable


def mfu_pct(
    tokens_per_sec: float | None, model_flops_per_token: float | None, peak_tflops: float | None, gpus: int | None
) -> float | None:
    """Model FLOPs utilisation in percent, or None when any input is unknown."""
    if not tokens_per_sec or not model_flops_per_token or not peak_tflops or not gpus:
        return None
    value = 100.0 * tokens_per_sec * model_flops_per_token / (peak_tflops * 1e12 * gpus)
    return value if math.isfinite(value) else None
