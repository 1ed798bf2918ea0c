"""The bf16 peaks `perf/mfu` divides by: found by the names torch gives the GPUs, the more specific
name first (an H100 PCIe is not an SXM H100); none for a CPU, an fp32 model or an unknown GPU."""

import pytest
import torch

from rft.trainer.flops import peak_of, peak_tflops


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0),
    ("Tesla V100-SXM2-32GB", None)])
def test_peaks_by_device_name(name, peak):
    assert peak_of(name) == peak


def test_no_peak_on_cpu_or_for_fp32_matmuls():
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    assert peak_tflops(torch.device("cuda", 0), torch.float32) is None
