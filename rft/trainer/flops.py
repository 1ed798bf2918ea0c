"""Model FLOPs of a trainer step, behind TensorBoard's `perf/model_tflops` and `perf/mfu`.

The usual estimate (Kaplan et al. 2020, as Megatron-LM and verl report MFU): 2 FLOPs per parameter
per token through a forward, 6 through a forward and backward; attention's score matmuls and any
recompute are left out (model FLOPs, not hardware FLOPs), as in tools/bench_trainer.py. Tokens are
the prompt and response tokens of the rows this rank forwards (no padding), parameters this rank's
shard's (TP, PP), so the MFU is one GPU's. A critic counts as a model of the policy's size.
"""

from __future__ import annotations

import torch

FORWARD, FORWARD_BACKWARD = 2, 6  # FLOPs per parameter per token

# dense (not 2:4 sparse) bf16/fp16 tensor-core peaks from the vendors' datasheets, TFLOP/s; the
# first name found in torch's device name wins, so the more specific names come first
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0),
               ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0))


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's bf16/fp16 peak for a model in `dtype`; None where it is not known (CPUs, fp32
    matmuls, a GPU missing from the table): no MFU is logged then, only model TFLOP/s."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
