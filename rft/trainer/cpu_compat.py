"""Run megatron-core's GPTModel on machines without CUDA (laptops, CI).

megatron-core 0.16 assumes CUDA in a few places that matter for a plain forward/backward:
  - `torch.cuda.current_device()` picks the device of rotary frequencies and some buffers;
  - the model-parallel RNG tracker saves/restores CUDA RNG state (`_get_cuda_rng_state`,
    `_set_cuda_rng_state`, `torch.cuda.manual_seed`, `torch.cuda.get_rng_state`);
  - with pipeline stages and tied embeddings, GPTModel calls `.cuda()` on the output layer copy
    before all-reducing it with the first stage (`Tensor.cuda` keeps the tensor where it is);
  - the pipeline schedules' p2p code calls `torch.cuda.synchronize()` after each exchange (a no-op
    here: there is no device stream to wait for), and the schedules count tokens in a tensor made
    with `device="cuda"` (`cuda_tensors_on_cpu`, around a schedule's call);
  - the MoE all-to-all token dispatcher copies its token counts to the host on a side CUDA stream
    (`torch.cuda.Stream`, `current_stream`, `stream`): here they are on the host already and
    work is ordered, so a stream that orders nothing stands in (`_HostStream`); and it hands
    all-to-all its split sizes as numpy arrays only when that copy ran (a CUDA tensor): host
    tensors are converted too (`_host_copy`);
  - Megatron's DDP and distributed optimizer allocate some buffers with `device="cuda"` and accept
    only parameters whose `.type()` names a CUDA tensor (`cuda_tensors_on_cpu` again, around each
    of rft/trainer/megatron_optimizer.py's calls).
Everything else the trainer uses (local layer spec, vocab-parallel layers, gloo collectives and
p2p, Megatron's 1F1B schedule) runs on CPU as is. This module redirects exactly those calls to
their CPU equivalents. It is applied only when CUDA is absent and is the one place such redirects
live. The CPU trainer itself steps torch AdamW under its own fp32 master weights
(rft/trainer/master_weights.py); Megatron's optimizer runs on CPU ranks in the tests, which hold
it to the same updates (tests/dist/test_megatron_optimizer.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def apply_cpu_redirects() -> bool:
    """Patch the CUDA-only calls if CUDA is unavailable; returns True if patched (idempotent)."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    def get_rng_state(*_args, **_kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
        torch.set_rng_state(state)

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # GPTModel moves a tied output layer to CUDA before syncing it across pipeline stages
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *_args, **_kwargs: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = get_rng_state  # type: ignore[assignment]
    mp_random._get_cuda_rng_state = get_rng_state
    mp_random._set_cuda_rng_state = set_rng_state
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *_args, **_kwargs: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *_args, **_kwargs: contextlib.nullcontext()  # type: ignore[assignment]
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _APPLIED = True
    return True


class _HostStream:
    """A CUDA stream (and its recorded event) where there is no device: host work is in order."""

    def __init__(self, *_args, **_kwargs):
        pass

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self, *_args) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu for tensors already on the host."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensors asked for with device="cuda" are made on the CPU instead, and a tensor's type name
    is its CUDA twin's ("torch.cuda.BFloat16Tensor": Megatron's optimizers check it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_tensors_on_cpu() -> Iterator[None]:
    """While open, and only without CUDA, a tensor created with device="cuda" lands on the CPU
    (Megatron's schedules make their token counter that way) and CPU tensors name CUDA types."""
    if torch.cuda.is_available():
        yield
        return
    with _CudaFactoriesOnCpu():
        yield
