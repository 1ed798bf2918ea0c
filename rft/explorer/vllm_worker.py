"""Inside vLLM's workers: the extension that makes each worker a receiver of rft's weight engine
(rft/weights/engines.py), mixed into vLLM's worker through `worker_extension_cls` by
rft/explorer/vllm_engine.py. Each received bucket goes through the model's own `load_weights`
inside vLLM's layerwise reload, the path vLLM's RLHF examples use; what vLLM 0.32 leaves undone
on an update (CPU MoE repacking, tied layers) is done here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Callable


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker) for weight updates."""

    def rft_open_weight_receiver(self, layout: dict, first_index: int) -> None:
        from rft.weights.engines import SyncLayout, make_receiver

        # one receiver per vLLM TP worker; `self.rank` is the worker's rank inside this engine. Opened
        # again when the job lost an engine: a checkpoint receiver keeps the version it has loaded
        previous = getattr(self, "rft_receiver", None)
        self.rft_receiver = make_receiver(SyncLayout(**layout), first_index + self.rank)
        if hasattr(previous, "version"):
            self.rft_receiver.version = previous.version
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
        with set_current_vllm_config(self.vllm_config), _cpu_experts_repacked(model):
            initialize_layerwise_reload(model)
            result = load(model.load_weights)
            start = time.perf_counter()
            finalize_layerwise_reload(model, self.model_config)
            _reprocess_tied_layers(model)
        return result, time.perf_counter() - start

    def rft_receive_weights(self, apply: bool = True, adapter: dict | None = None, version: int | None = None,
                            keep_in: str | None = None) -> tuple[int, float, str | None, str | None]:
        """Receive one sync and load it; (version, seconds after the last bucket, adapter dir, the
        directory of the copy kept). `version`: the one the trainer publishes now, where the
        engine can tell (the checkpoint engine's directory may hold newer ones, written before a
        crash). `keep_in` (rollout.on_engine_failure=restart): worker 0 also writes the weights as
        they arrive to <keep_in>/v<version>, an HF directory a restarted engine loads.

        `adapter` (a LoRA stage with sync.lora=adapter: {"dir", "rank", "alpha", "base"}): the sync
        holds PEFT-named adapter tensors, after the stage's base weights when "base" is set; the
        base weights are loaded as usual and the adapter written to <dir>/v<version> for vLLM's
        LoRA (the engine passes it with every request)."""
        if not apply:  # receive and discard: tools/bench_weight_sync.py times the wire alone
            return (*self.rft_receiver.receive(lambda named: None, version), None, None)
        if adapter is None:
            copy = WeightCopy(keep_in) if keep_in is not None and self.rank == 0 else None
            (got, tail_s), finalize_s = self._rft_reload(
                lambda lw: self.rft_receiver.receive(copy.keeping(lw) if copy else lw, version))
            return got, tail_s + finalize_s, None, copy.commit(got) if copy else None
        lora: dict = {}

        def keeping_adapter(load_weights: Callable) -> Callable:
            def load(named) -> None:
                base = []
                for name, tensor in named:
                    if ".lora_A." in name or ".lora_B." in name:
                        lora[name] = tensor.clone()  # the bucket's buffer is reused
                    else:
                        base.append((name, tensor))
                if base:
                    load_weights(base)
            return load

        if adapter["base"]:
            (got, tail_s), finalize_s = self._rft_reload(
                lambda lw: self.rft_receiver.receive(keeping_adapter(lw), version))
        else:  # the model is untouched: no reload, no re-processing
            (got, tail_s), finalize_s = self.rft_receiver.receive(keeping_adapter(lambda named: None), version), 0.0
        path = os.path.join(adapter["dir"], f"v{got}")
        if self.rank == 0:  # one writer per engine; the engine reads it once every worker returned
            write_peft_adapter(path, lora, adapter["rank"], adapter["alpha"])
        return got, tail_s + finalize_s, path, None

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


class WeightCopy:
    """The weights of one sync written as they arrive, each bucket a safetensors file of HF-named
    tensors, into <root>/v<version> (a temporary directory renamed into place; the one before
    removed): what rollout.on_engine_failure=restart loads into a restarted engine (the trainer
    is not asked to send again, and the version is exactly the one served). The bucket's
    buffers are reused for the next, so each tensor is copied to host memory first."""

    def __init__(self, root: str):
        self.root, self.buckets = root, 0
        self.tmp = os.path.join(root, f"incoming{os.getpid()}")
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)

    def keeping(self, load_weights: Callable) -> Callable:
        from safetensors.torch import save_file

        def load(named):
            named = list(named)
            save_file({name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in named},
                      os.path.join(self.tmp, f"bucket{self.buckets:05d}.safetensors"))
            self.buckets += 1
            return load_weights(named)
        return load

    def commit(self, version: int) -> str:
        import shutil

        path = os.path.join(self.root, f"v{version}")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(self.tmp, path)
        for old in os.listdir(self.root):  # one copy is enough: the newest
            if old != f"v{version}":
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        return path


def write_peft_adapter(path: str, tensors: dict, rank: int, alpha: float) -> None:
    """A PEFT LoRA checkpoint (adapter_config.json, adapter_model.safetensors), written to a
    temporary directory and renamed into place, so a reader never sees half of one."""
    import json
    import shutil

    from safetensors.torch import save_file

    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in tensors})
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "adapter_model.safetensors"))
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                   "target_modules": modules, "lora_dropout": 0.0, "bias": "none"}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _rotary_noise(record: logging.LogRecord) -> bool:
    """Drop vLLM's per-sync "RotaryEmbedding: Failed to load weights": its cos/sin cache is a
    buffer that no checkpoint carries, so the reload warns on every update although the cache is
    put back untouched."""
    return not (record.msg == "%s: Failed to load weights" and record.args
                and str(record.args[0]).endswith("RotaryEmbedding"))


@contextlib.contextmanager
def _cpu_experts_repacked(model) -> Iterator[None]:
    """Make a weight update re-pack the MoE expert weights on vLLM's CPU backend.

    On the first load vLLM's unquantized MoE method hands the expert weights to its kernel's own
    post-processing, which on CPU pads the intermediate size to a multiple of 32 and packs them
    for its grouped GEMM. On a weight update (vLLM 0.32, `_setup_kernel`) it skips that step, so
    the CPU kernel reads checkpoint-layout weights as if packed: logprobs off by 0.035 on the
    test model after reloading unchanged weights, and a layer whose intermediate size needs
    padding fails to copy back ("size 128 vs 96"). Inside the layerwise reload, each expert
    layer's processing is followed by the kernel's, so the padded, packed tensors are what is
    copied back into the kernel's storage; restored after. GPU backends keep their layout
    transform in the method itself and are left alone.
    """
    from vllm.platforms import current_platform

    patched = []
    if current_platform.is_cpu():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if experts is None or not hasattr(experts, "process_weights_after_loading"):
                continue

            def process_then_repack(layer, process=method.process_weights_after_loading, experts=experts):
                process(layer)
                experts.process_weights_after_loading(layer)

            method.process_weights_after_loading = process_then_repack
            patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading  # the class's method again


def _reprocess_tied_layers(model) -> None:
    """Re-run weight post-processing for layers that share a weight (a tied lm_head).

    The layerwise reload re-processes only layers that received tensors; a tied lm_head receives
    none (its weight is embed_tokens'), so on CPU its packed GEMM copy would keep the old weights.
    The first module of a group in `model.modules()` order is the one the tensor was loaded into
    (named_parameters names a shared weight after it, in the same order), already re-processed:
    only the others are (on CPU each is a repacking of the vocabulary x hidden matrix).
    """
    import torch

    sharing: dict[int, list] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type != "meta" and \
                hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            sharing.setdefault(weight.data_ptr(), []).append(module)
    for modules in sharing.values():
        for module in modules[1:]:
            module.quant_method.process_weights_after_loading(module)
