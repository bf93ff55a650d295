"""Nominal peaks of the accelerators the benchmarks report against (vendor data sheets, dense,
no sparsity): matmul FLOP/s per operand precision and HBM bandwidth, by `device_kind`.

    peak = device_peaks.lookup(jax.devices()[0].device_kind)   # None on a CPU or an unknown chip
    peak.flops("bfloat16") -> FLOP/s;  peak.hbm_bytes_per_s -> bytes/s

A benchmark row's `peak_fraction` is its achieved GEMM FLOP/s over `flops(precision)`, where
the precision is what the step's GEMMs ran at: "bfloat16" operands, "tf32" (float32 operands
at XLA's default precision on NVIDIA GPUs), or "float32" (`Precision.HIGHEST`).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Peak:
    name: str
    bf16_tflops: float
    tf32_tflops: float
    f32_tflops: float
    hbm_gb_s: float

    def flops(self, precision: str) -> float:
        """Peak FLOP/s for GEMM operands in `precision` ("bfloat16" | "tf32" | "float32")."""
        tflops = {"bfloat16": self.bf16_tflops, "tf32": self.tf32_tflops, "float32": self.f32_tflops}[precision]
        return tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gb_s * 1e9


# Matched in order on the lower-cased device_kind (the first key it contains wins, so the
# more specific names come first). TPUs: float32 GEMMs run as bf16 passes; tf32 / f32 left at
# the bf16 figure divided by the pass count XLA uses (3 for HIGH, 6 for HIGHEST).
_TABLE = (
    ("h100 pcie", Peak("H100 PCIe", 756, 378, 51, 2000)),
    ("h100 nvl", Peak("H100 NVL", 835, 418, 60, 3900)),
    ("gh200", Peak("GH200", 989, 495, 67, 4000)),
    ("h200 nvl", Peak("H200 NVL", 835, 418, 60, 4800)),
    ("h200", Peak("H200 SXM", 989, 495, 67, 4800)),
    ("h100", Peak("H100 SXM", 989, 495, 67, 3350)),
    ("a100", Peak("A100 SXM", 312, 156, 19.5, 2039)),
    ("l4", Peak("L4", 121, 60, 30, 300)),
    ("tpu v6 lite", Peak("TPU v6e", 918, 306, 153, 1640)),
    ("tpu v5 lite", Peak("TPU v5e", 197, 66, 33, 819)),
    ("tpu v5", Peak("TPU v5p", 459, 153, 77, 2765)),
    ("tpu v4", Peak("TPU v4", 275, 92, 46, 1228)),
)


def lookup(device_kind: str | None = None) -> Peak | None:
    """The peak of `device_kind` (default: the first JAX device's); None when not in the table."""
    kind = (device_kind if device_kind is not None else jax.devices()[0].device_kind).lower()
    return next((peak for key, peak in _TABLE if key in kind), None)


def gemm_precision(operand_dtype: str, matmul_precision: str, platform: str) -> str:
    """The precision a step's GEMMs run at, for the peak to compare with: bf16 operands are
    "bfloat16"; float32 operands run at `matmul_precision` ("float32", "tf32", "bf16", or
    "default": JAX's default, which is TF32 on a GPU and one bfloat16 pass on a TPU; the train
    step runs at it, and on the H200 its float32 GEMMs ran at 1.05-2.09x the FP32 peak)."""
    if operand_dtype == "bfloat16" or matmul_precision == "bf16":
        return "bfloat16"
    if matmul_precision == "default":
        return {"gpu": "tf32", "tpu": "bfloat16"}.get(platform, "float32")
    if matmul_precision == "tf32" and platform == "gpu":
        return "tf32"
    return "float32"


def fraction(flops_per_s: float, precision: str, device_kind: str | None = None) -> dict:
    """`{"peak_flops", "peak_fraction", "peak_device"}` (None values off the table)."""
    peak = lookup(device_kind)
    if peak is None:
        return {"peak_flops": None, "peak_fraction": None, "peak_device": None}
    p = peak.flops(precision)
    return {"peak_flops": p, "peak_fraction": round(flops_per_s / p, 4), "peak_device": peak.name}
