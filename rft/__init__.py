"""rft: Slurm-native reinforcement fine-tuning of LLMs (Megatron-core trainers, vLLM rollouts)."""
