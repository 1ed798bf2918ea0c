"""LoRA weight sync end to end (sync.lora): a TP=2 Megatron trainer (gloo ranks) trains LoRA
adapters and publishes through the run's `WeightPublisher` to a real vLLM engine (CPU build, LoRA
enabled) three times: merged (W + B A, every weight), as an adapter after the base weights (an
adapter stage's first sync), and as an adapter alone after more training. vLLM's logprobs of
fixed sequences must be the same for merged and adapter syncs of the same weights, and equal the
trainer's own after the adapter-only sync; an adapter-only sync moves far fewer bytes."""

import multiprocessing
import os

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

from tests.dist.test_weight_sync import SEQUENCES, _config, _info

RANK, ALPHA = 4, 8.0


def _trainer(rank: int, world: int, cfg, port: int, out: str) -> None:
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.lora import LoRA
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.publisher import WeightPublisher
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size)
    model, geo = build_gpt_model(cfg.model.path)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    lora = LoRA(model, geo, RANK, ALPHA, 0.0, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], 0).attach()
    optimizer = build_optimizer(lora, lr=2e-2)
    batch = StepBatch(prompt_ids=[s[:4] for s in SEQUENCES], response_ids=[s[4:] for s in SEQUENCES])

    def train(steps: int) -> None:
        for _ in range(steps):
            train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), micro_batch_size=1, pad_id=0)

    publisher = WeightPublisher(cfg, _info(cfg, rank, port + 10), geo)
    train(3)
    sent = {}
    publisher.begin_stage(lora, adapter_sync=False)
    sent["merged"] = publisher.publish(model, 1)
    publisher.begin_stage(lora, adapter_sync=True)
    sent["adapter_with_base"] = publisher.publish(model, 2)
    train(2)
    sent["adapter"] = publisher.publish(model, 3)
    mb = pack_microbatch([s[:1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], 0, torch.device("cpu"))
    logprobs = forward_logprobs_pipelined(model, [mb])
    if ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"logprobs": logprobs[0], "sent": sent}, out)


@pytest.mark.slow
def test_merged_and_adapter_syncs_serve_the_same_policy(tmp_path):
    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.weights.engines import sync_layout

    model_dir = create_family_model("qwen2", str(tmp_path / "model"))
    cfg = _config(model_dir, str(tmp_path / "run"), tp=2, pp=1, rollout_tp=1, engine="gloo")
    engine = RolloutEngine(ModelConfig(name="qwen2", path=model_dir), RolloutConfig(kv_cache_gb=0.1), seed=0,
                           max_model_len=64, max_lora_rank=8)
    base = engine.prompt_logprobs(SEQUENCES)
    port, out = free_port(), str(tmp_path / "trainer.pt")
    trainer = multiprocessing.get_context("spawn").Process(target=spawn, args=(_trainer, 2, cfg, port, out))
    trainer.start()
    engine.open_weight_receiver(sync_layout(cfg, _info(cfg, 2, port + 10), False), 0)
    adapter = {"dir": str(tmp_path / "adapters"), "rank": RANK, "alpha": ALPHA, "base": True}
    engine.receive_weights()
    merged = engine.prompt_logprobs(SEQUENCES)
    assert engine.lora_request is None
    engine.receive_weights(adapter=adapter)
    as_adapter = engine.prompt_logprobs(SEQUENCES)
    assert engine.lora_request is not None and os.path.exists(os.path.join(engine.lora_request.lora_path,
                                                                           "adapter_config.json"))
    engine.receive_weights(adapter={**adapter, "base": False})
    after = engine.prompt_logprobs(SEQUENCES)
    trainer.join(timeout=300)
    assert trainer.exitcode == 0
    trained = torch.load(out)
    for row in range(len(SEQUENCES)):
        m, a, b = torch.tensor(merged[row]), torch.tensor(as_adapter[row]), torch.tensor(base[row])
        assert (m - b).abs().max() > 1e-2  # the adapters changed the policy ...
        assert (a - m).abs().max() <= 1e-3  # ... and vLLM's LoRA serves what the merged weights do
        expected = trained["logprobs"][row, : len(after[row])]
        assert (torch.tensor(after[row]) - expected).abs().max() <= 1e-3  # adapter only: the trainer's policy
        assert (torch.tensor(after[row]) - a).abs().max() > 1e-3  # ... which moved since
    sent = trained["sent"]
    assert sent["adapter"] < sent["merged"] / 5 and sent["adapter_with_base"] > sent["merged"]
    engine.close()
