"""Weight sync end to end: a Megatron trainer (TP/PP on gloo ranks) takes a few AdamW steps and
publishes through the run's own `WeightPublisher`; a real vLLM engine (CPU build) receives through
its worker extension. vLLM's logprobs of fixed sequences then equal the trainer's and differ from
the checkpoint's. Engines: gloo broadcast and the filesystem checkpoint; nccl where a GPU is."""

import os

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

from rft.config import RFTConfig
from rft.runtime.topology import Topology
from rft.weights.engines import sync_layout

SEQUENCES = [[5, 6, 14, 7, 8, 17, 9, 10, 2], [12, 13, 14, 20, 21, 17, 30, 31]]
# vLLM caches its environment at the first engine start; tests start several engines in one
# process, so set now what RolloutEngine sets for a TP>1 engine (see rft/explorer/vllm_engine.py)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _config(model_dir: str, run_dir: str, tp: int, pp: int, rollout_tp: int, engine: str, ep: int = 1) -> RFTConfig:
    cfg = RFTConfig()
    cfg.model.path, cfg.run.output_dir = model_dir, run_dir
    cfg.cluster.trainer_ranks = tp * pp * ep  # EP splits the data-parallel ranks: DP = EP here
    cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size = tp, pp
    cfg.trainer.expert_parallel_size = ep
    cfg.rollout.tensor_parallel_size = rollout_tp
    cfg.sync.engine, cfg.sync.bucket_mb, cfg.sync.timeout_s = engine, 1, 120
    return cfg


def _info(cfg: RFTConfig, rank: int, port: int) -> Topology:
    cfg.cluster.rollout_ranks = 1  # this process plays the one rollout rank
    return Topology.of(cfg, rank, "127.0.0.1", port)


def _trainer(rank: int, world: int, cfg: RFTConfig, port: int, out: str) -> None:
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.publisher import WeightPublisher
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    if cfg.sync.engine == "nccl":  # NCCL needs its ranks on distinct GPUs; vLLM has GPU 0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(1 + rank)
    init_gloo(rank, world, port, cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size,
              ep=cfg.trainer.expert_parallel_size)
    model, geo = build_gpt_model(cfg.model.path)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    optimizer = build_optimizer(model, lr=1e-2)
    batch = StepBatch(prompt_ids=[s[:4] for s in SEQUENCES], response_ids=[s[4:] for s in SEQUENCES])
    for _ in range(3):  # a few real optimizer steps move the weights away from the checkpoint
        train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), micro_batch_size=1, pad_id=0)
    device = next(model.parameters()).device
    mb = pack_microbatch([s[:1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], 0, device)
    logprobs = forward_logprobs_pipelined(model, [mb])
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"logprobs": logprobs[0].cpu(), "mask": mb.loss_mask.cpu()}, out)
    publisher = WeightPublisher(cfg, _info(cfg, rank, port + 10), geo)
    publisher.publish(model, 7)


def _vllm_logprobs(engine) -> list[list[float]]:
    return engine.prompt_logprobs(SEQUENCES)


def _sync_and_compare(tmp_path, family: str, tp: int, pp: int, rollout_tp: int, engine_name: str, ep: int = 1) -> None:
    import multiprocessing

    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine

    model_dir = create_family_model(family, str(tmp_path / "model"))
    cfg = _config(model_dir, str(tmp_path / "run"), tp, pp, rollout_tp, engine_name, ep)
    world = cfg.cluster.trainer_ranks
    engine = RolloutEngine(ModelConfig(name=family, path=model_dir),
                           RolloutConfig(kv_cache_gb=0.1, tensor_parallel_size=rollout_tp),
                           seed=0, max_model_len=64)
    before = _vllm_logprobs(engine)
    port, out = free_port(), str(tmp_path / "trainer.pt")
    # the trainer ranks run beside this process, which plays rollout rank T (as in a job)
    trainer = multiprocessing.get_context("spawn").Process(
        target=spawn, args=(_trainer, world, cfg, port, out))
    trainer.start()
    on_gpu = engine_name == "nccl"
    engine.open_weight_receiver(sync_layout(cfg, _info(cfg, world, port + 10), on_gpu), 0)
    apply_s = engine.receive_weights()
    trainer.join(timeout=300)
    assert trainer.exitcode == 0
    assert engine.version == 7 and apply_s >= 0
    after = _vllm_logprobs(engine)
    trained = torch.load(out)
    for row, (b, a) in enumerate(zip(before, after)):
        expected = trained["logprobs"][row, : len(a)]
        assert torch.all(trained["mask"][row, : len(a)] == 1)
        assert (torch.tensor(a) - expected).abs().max().item() <= 1e-3  # vLLM now scores like the trainer
        assert (torch.tensor(b) - expected).abs().max().item() > 1e-2  # ... and not like before
    if engine_name == "checkpoint":  # what was written is a consolidated HF checkpoint
        from transformers import AutoModelForCausalLM

        version_dir = os.path.join(cfg.run.output_dir, "weights", "v000007")
        AutoModelForCausalLM.from_pretrained(version_dir)


@pytest.mark.slow
def test_tp2_trainer_to_vllm_over_gloo(tmp_path):
    """Qwen2 with Qwen2.5's YaRN RoPE: vLLM's YaRN and the trainer's agree."""
    _sync_and_compare(tmp_path, "qwen2_yarn", tp=2, pp=1, rollout_tp=1, engine_name="gloo")


@pytest.mark.slow
def test_pp2_trainer_to_vllm_tp2_over_gloo(tmp_path):
    """Two senders (one per stage) into two vLLM TP workers; tied embeddings cross stages; Llama
    3.1's scaled RoPE on both sides."""
    _sync_and_compare(tmp_path, "llama3", tp=1, pp=2, rollout_tp=2, engine_name="gloo")


@pytest.mark.slow
def test_tp2_trainer_to_vllm_through_checkpoint(tmp_path):
    _sync_and_compare(tmp_path, "qwen3", tp=2, pp=1, rollout_tp=1, engine_name="checkpoint")


@pytest.mark.slow
def test_moe_trainer_ep2_to_vllm_over_gloo(tmp_path):
    """Qwen3-MoE: two trainer ranks each hold half the experts (EP=2) and the export gathers them;
    vLLM's CPU MoE kernel re-packs the updated experts (its intermediate size padded to 64)."""
    _sync_and_compare(tmp_path, "qwen3_moe", tp=1, pp=1, rollout_tp=1, engine_name="gloo", ep=2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs a GPU per rank: vLLM + 2 trainer ranks")
def test_tp2_trainer_to_vllm_over_nccl(tmp_path):
    """The GPU path: trainer ranks on GPUs 1-2, vLLM on GPU 0, weights over a stateless NCCL group."""
    _sync_and_compare(tmp_path, "qwen2", tp=2, pp=1, rollout_tp=1, engine_name="nccl")
