"""Model directories rft builds locally: a tiny random Qwen2 and SmolLM2-135M from its GGUF."""
