"""The rollout engine: vLLM's `LLM` plus a worker extension that receives trainer weights.

vLLM runs its worker in a child process with its own torch.distributed world. The extension
(`WeightReceiver`, mixed into vLLM's worker through `worker_extension_cls`) joins rft's separate
weight group (see rft/weights/group.py) from inside that worker and calls the model's own
`load_weights` for each bucket, which is the path vLLM's RLHF examples use.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from rft.config import ModelConfig, RolloutConfig


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker) for weight updates."""

    def rft_join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                              timeout_s: float, peer_names: list[str]) -> None:
        from rft.weights.group import open_weight_group

        self.rft_group = open_weight_group(host, port, rank, world_size, timeout_s, peer_names)

    def rft_receive_weights(self, bucket_bytes: int) -> tuple[int, float]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from rft.weights.transfer import receive_weights

        # vLLM post-processes weights after loading (repacking on CPU, for one); its layerwise
        # reload restores the loaders before and re-runs that processing after, as its own
        # checkpoint-format transfer engines do.
        model = self.model_runner.model
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            version, tail_s = receive_weights(self.rft_group, model.load_weights, bucket_bytes)
            start = time.perf_counter()
            finalize_layerwise_reload(model, self.model_config)
        return version, tail_s + time.perf_counter() - start


@dataclass
class Sample:
    """One generated response with the logprob vLLM assigned each of its tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    text: str
    finished: bool  # ended with EOS/stop rather than the length limit


class RolloutEngine:
    """A vLLM engine for one rollout rank; `version` is the policy version it serves."""

    def __init__(self, model: ModelConfig, rollout: RolloutConfig, seed: int, max_model_len: int):
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        # Keep vLLM's engine core in this process (TP=1): every generate/weight-load call is then a
        # function call instead of a ZeroMQ round trip, which the synchronous loop pays each step.
        if rollout.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        import torch

        on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=model.path,
            dtype=model.dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=rollout.max_num_seqs,
            tensor_parallel_size=rollout.tensor_parallel_size,
            worker_extension_cls="rft.explorer.vllm_engine.WeightReceiver",
            enable_prefix_caching=True,
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        else:
            # On CPU "gpu_memory_utilization" is a share of the NUMA node's RAM; size the KV cache
            # directly instead (DESIGN.md section 6) and skip compilation, which only costs start-up.
            kwargs["kv_cache_memory_bytes"] = int(rollout.kv_cache_gb * 2**30)
            kwargs["enforce_eager"] = True
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                          timeout_s: float, peer_names: list[str]) -> None:
        self.llm.collective_rpc("rft_join_weight_group",
                                args=(host, port, rank, world_size, timeout_s, peer_names))

    def receive_weights(self, bucket_bytes: int) -> float:
        """Block until the trainer's next sync arrives and load it (sets `version`).

        Returns the seconds spent after the last bucket arrived (loading, re-processing, cache
        reset): the rollout side's share of the sync, which the sender's timing does not include.
        """
        replies = self.llm.collective_rpc("rft_receive_weights", args=(bucket_bytes,))
        start = time.perf_counter()
        self.version = int(replies[0][0])
        # Cached KV blocks were computed by the old weights; drop them.
        self.llm.reset_prefix_cache()
        return float(replies[0][1]) + time.perf_counter() - start

    def generate(self, prompts: list[str], n: int, max_new_tokens: int, temperature: float,
                 top_p: float, stop: list[str], seed: int) -> list[list[Sample]]:
        """Sample `n` responses per prompt; returns one list of samples per prompt."""
        from vllm import SamplingParams

        # One seed per prompt: reproducible, and prompts do not share a random stream.
        params = [SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, stop=stop or None, logprobs=0, seed=seed + i)
                  for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        groups = []
        for out in outputs:
            samples = []
            for comp in out.outputs:
                ids = list(comp.token_ids)
                logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, ids)]
                samples.append(Sample(prompt_ids=list(out.prompt_token_ids), response_ids=ids,
                                      response_logprobs=logprobs, text=comp.text,
                                      finished=comp.finish_reason == "stop"))
            groups.append(samples)
        return groups
