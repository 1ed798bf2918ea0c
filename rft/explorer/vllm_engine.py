"""The rollout engine: vLLM's `LLM` plus a worker extension that receives trainer weights.

vLLM's workers have their own torch.distributed world. The extension (`WeightReceiver`, mixed
into vLLM's worker through `worker_extension_cls`) makes every worker a receiver of rft's weight
engine (rft/weights/engines.py) and calls the model's own `load_weights` for each bucket, which is
the path vLLM's RLHF examples use.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rft.config import ModelConfig, RolloutConfig

if TYPE_CHECKING:
    from rft.weights.engines import SyncLayout


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker) for weight updates."""

    def rft_open_weight_receiver(self, layout: dict, first_index: int) -> None:
        from rft.weights.engines import SyncLayout, make_receiver

        # one receiver per vLLM TP worker; `self.rank` is the worker's rank inside this engine
        self.rft_receiver = make_receiver(SyncLayout(**layout), first_index + self.rank)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_rotary_noise)

    def _rft_reload(self, load: "Callable[[Callable], object]") -> tuple[object, float]:
        """Run `load(model.load_weights)` inside vLLM's layerwise reload; (its result, seconds
        spent after it returned re-processing the weights)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        # vLLM post-processes weights after loading (repacking on CPU, for one); its layerwise
        # reload restores the loaders before and re-runs that processing after, as its own
        # checkpoint-format transfer engines do. `load_weights` takes full HF tensors and keeps
        # this worker's TP slice, so any trainer TP/PP maps onto any rollout TP.
        model = self.model_runner.model
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            result = load(model.load_weights)
            start = time.perf_counter()
            finalize_layerwise_reload(model, self.model_config)
            _reprocess_tied_layers(model)
        return result, time.perf_counter() - start

    def rft_receive_weights(self, apply: bool = True) -> tuple[int, float]:
        if not apply:  # receive and discard: tools/bench_weight_sync.py times the wire alone
            return self.rft_receiver.receive(lambda named: None)
        (version, tail_s), finalize_s = self._rft_reload(self.rft_receiver.receive)
        return version, tail_s + finalize_s

    def rft_load_hf_dir(self, path: str) -> int:
        """Load every tensor of the HF checkpoint in `path` (its *.safetensors); returns how many."""
        import glob

        from safetensors import safe_open

        def tensors():
            for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        def load(load_weights) -> int:
            names = list(load_weights(tensors()) or [])
            return len(names)

        loaded, _ = self._rft_reload(load)
        if not loaded:
            raise RuntimeError(f"no weights loaded from {path}: no *.safetensors there?")
        return loaded

    def rft_raw_broadcast(self, nbytes: int) -> None:
        """Receive one flat tensor of `nbytes` on the first weight group: the bandwidth bound that
        tools/bench_weight_sync.py compares a sync against."""
        import torch

        group = self.rft_receiver.groups[0]
        group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device), "raw bandwidth probe")


def _rotary_noise(record: logging.LogRecord) -> bool:
    """Drop vLLM's per-sync "RotaryEmbedding: Failed to load weights": its cos/sin cache is a
    buffer that no checkpoint carries, so the reload warns on every update although the cache is
    put back untouched."""
    return not (record.msg == "%s: Failed to load weights" and record.args
                and str(record.args[0]).endswith("RotaryEmbedding"))


def _reprocess_tied_layers(model) -> None:
    """Re-run weight post-processing for layers that share a weight (a tied lm_head).

    The layerwise reload re-processes only layers that received tensors; a tied lm_head receives
    none (its weight is embed_tokens'), so on CPU its packed GEMM copy would keep the old weights.
    """
    import torch

    sharing: dict[int, list] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type != "meta" and \
                hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            sharing.setdefault(weight.data_ptr(), []).append(module)
    for modules in sharing.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)


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
        else:
            # vLLM's CPU build pins each TP worker to its own NUMA node and refuses to start when
            # there are fewer nodes than workers (one-socket machines); let the OS place threads.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
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

    def open_weight_receiver(self, layout: "SyncLayout", first_index: int) -> None:
        """Make every vLLM worker a receiver (indices first_index, first_index + 1, ...)."""
        self.llm.collective_rpc("rft_open_weight_receiver", args=(layout.as_dict(), first_index))

    def receive_weights(self, apply: bool = True) -> float:
        """Block until the trainer's next sync arrives and load it (sets `version`).

        Returns the seconds spent after the last bucket arrived (loading, re-processing, cache
        reset): the rollout side's share of the sync, which the sender's timing does not include.
        """
        replies = self.llm.collective_rpc("rft_receive_weights", args=(apply,))
        start = time.perf_counter()
        if not apply:
            return float(replies[0][1])
        self.version = int(replies[0][0])
        # Cached KV blocks were computed by the old weights; drop them.
        self.llm.reset_prefix_cache()
        return float(replies[0][1]) + time.perf_counter() - start

    def load_hf_dir(self, path: str) -> None:
        """Serve the weights of the HF checkpoint in `path` (same architecture as the engine's)."""
        self.llm.collective_rpc("rft_load_hf_dir", args=(path,))
        self.llm.reset_prefix_cache()

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
