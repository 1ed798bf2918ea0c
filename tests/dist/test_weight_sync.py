"""Weight sync: a Megatron trainer's updated weights, sent over the gloo weight group, make real
vLLM (CPU build) score sequences exactly as the trainer does, and differently from before."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from rft.config import AlgorithmConfig, ModelConfig, RolloutConfig, TinyModelConfig
from rft.models.tiny import create_tiny_model

SEQUENCES = [[5, 6, 14, 7, 8, 17, 9, 10, 2], [12, 13, 14, 20, 21, 17, 30, 31]]
PEERS = ["trainer rank 0", "rollout rank 1"]


def _ports() -> tuple[int, int]:
    from rft.cluster import free_port

    port = free_port()
    return port, port + 1


def _trainer(model_dir: str, trainer_port: int, weight_port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from rft.trainer.forward import forward_logprobs, pack_microbatch
    from rft.trainer.model import (build_gpt_model, export_hf_weights, init_model_parallel,
                                   load_hf_state, load_hf_weights)
    from rft.trainer.train_step import StepBatch, train_step
    from rft.weights.group import open_weight_group
    from rft.weights.transfer import send_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(trainer_port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = StepBatch(prompt_ids=[s[:4] for s in SEQUENCES], response_ids=[s[4:] for s in SEQUENCES])
    for _ in range(3):  # a few real optimizer steps move the weights away from the checkpoint
        train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), micro_batch_size=2, pad_id=0)
    with torch.no_grad():
        mb = pack_microbatch([s[:1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], 0, torch.device("cpu"))
        logprobs, _ = forward_logprobs(model, mb, with_entropy=False)
    torch.save({"logprobs": logprobs, "mask": mb.loss_mask}, out)
    group = open_weight_group("127.0.0.1", weight_port, 0, 2, 120, PEERS)
    send_weights(group, export_hf_weights(model, geo), 7, 1 << 16, torch.float32)


def _vllm_logprobs(engine) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in SEQUENCES], params, use_tqdm=False)
    return [[step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], s[1:])]
            for o, s in zip(outs, SEQUENCES)]


@pytest.mark.slow
def test_weight_sync_makes_vllm_match_the_trainer(tmp_path):
    from rft.explorer.vllm_engine import RolloutEngine

    model_dir = create_tiny_model(TinyModelConfig(), str(tmp_path / "model"), seed=0)
    engine = RolloutEngine(ModelConfig(name="tiny", path=model_dir), RolloutConfig(kv_cache_gb=0.1),
                           seed=0, max_model_len=64)
    before = _vllm_logprobs(engine)
    trainer_port, weight_port = _ports()
    out = str(tmp_path / "trainer.pt")
    proc = mp.get_context("spawn").Process(target=_trainer, args=(model_dir, trainer_port, weight_port, out))
    proc.start()
    engine.join_weight_group("127.0.0.1", weight_port, 1, 2, 120, PEERS)
    apply_s = engine.receive_weights(1 << 16)
    proc.join(timeout=120)
    assert proc.exitcode == 0
    assert engine.version == 7 and apply_s >= 0
    after = _vllm_logprobs(engine)
    trained = torch.load(out)
    for row, (b, a) in enumerate(zip(before, after)):
        n = len(a)
        expected = trained["logprobs"][row, :n]
        assert torch.all(trained["mask"][row, :n] == 1)
        assert (torch.tensor(a) - expected).abs().max().item() <= 1e-3  # vLLM now scores like the trainer
        assert (torch.tensor(b) - expected).abs().max().item() > 1e-2  # ... and not like before
