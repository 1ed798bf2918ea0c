"""megatron-core GPTModel at TP=2 on two gloo ranks computes the logits of TP=1 (and of HF)."""

import pytest
import torch
from dist_models import free_port, init_gloo, spawn

from rft.config import TinyModelConfig
from rft.models.tiny import create_tiny_model

SEQUENCES = [[1, 5, 6, 14, 7, 8, 17, 9, 10, 2], [1, 12, 13, 14, 20, 21, 17, 30, 31, 32]]


def _worker(rank: int, world: int, tp: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.trainer.forward import vocab_parallel_logprobs
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state

    init_gloo(rank, world, port, tp, pp=1)
    from megatron.core import parallel_state

    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    ids = torch.tensor(SEQUENCES)
    with torch.no_grad():
        local = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids),
                      attention_mask=None)
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous())
        full = torch.cat(shards, dim=-1)[..., : geo.vocab_size]
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        vocab_start = parallel_state.get_tensor_model_parallel_rank() * local.shape[-1]
        logprobs, entropy = vocab_parallel_logprobs(local[:, :-1], ids[:, 1:], group, vocab_start)
    if rank == 0:
        torch.save({"logits": full, "logprobs": logprobs, "entropy": entropy}, out)
    dist.destroy_process_group()


def _run(world: int, tp: int, model_dir: str, out: str) -> dict:
    spawn(_worker, world, tp, free_port(), model_dir, out)
    return torch.load(out)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    return create_tiny_model(TinyModelConfig(), str(path), seed=0)


def test_tp2_logits_equal_tp1_and_transformers(tiny_model, tmp_path):
    tp1 = _run(1, 1, tiny_model, str(tmp_path / "tp1.pt"))
    tp2 = _run(2, 2, tiny_model, str(tmp_path / "tp2.pt"))
    assert (tp2["logits"] - tp1["logits"]).abs().max().item() <= 1e-5
    assert (tp2["logprobs"] - tp1["logprobs"]).abs().max().item() <= 1e-5
    assert (tp2["entropy"] - tp1["entropy"]).abs().max().item() <= 1e-5

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        ref = hf(torch.tensor(SEQUENCES)).logits
    assert (tp1["logits"] - ref).abs().max().item() <= 1e-4
    # the vocab-parallel logprob/entropy path agrees with a plain log_softmax over full logits
    full_logp = torch.log_softmax(ref[:, :-1], dim=-1)
    picked = full_logp.gather(-1, torch.tensor(SEQUENCES)[:, 1:, None]).squeeze(-1)
    assert (tp2["logprobs"] - picked).abs().max().item() <= 1e-4
    ent = -(full_logp.exp() * full_logp).sum(-1)
    assert (tp2["entropy"] - ent).abs().max().item() <= 1e-4
