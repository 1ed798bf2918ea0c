"""Shared test setup: where the GSM8K files live (the checkout sits beside ../shared)."""

import os
import signal

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.environ.get("RFT_GSM8K_DIR") or os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
os.environ["RFT_GSM8K_DIR"] = GSM8K_DIR

# A shell starts a background command (CI under `&` or nohup) with SIGINT ignored, and every process
# a test starts inherits that: Python then never raises KeyboardInterrupt, and a test's Ctrl-C of a
# launcher was silently dropped (the launcher ran on until the test's timeout). A handler (unlike
# SIG_IGN) is reset to the default across exec, so children get Ctrl-C back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def gsm8k_dir() -> str:
    if not os.path.exists(os.path.join(GSM8K_DIR, "train.jsonl")):
        pytest.skip(f"GSM8K files not found in {GSM8K_DIR}; set RFT_GSM8K_DIR")
    return GSM8K_DIR


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where CUDA is present and are skipped elsewhere (CI, laptops)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
