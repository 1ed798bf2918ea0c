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
    fused = _fused_output_layer(model, ids, tp, group)
    if rank == 0:
        torch.save({"logits": full, "logprobs": logprobs, "entropy": entropy, **fused}, out)
    dist.destroy_process_group()


HIDDEN, VOCAB, PADDED_VOCAB, POSITIONS = 8, 13, 16, 11  # the chunked case's shapes: 3 padding columns


def chunked_case() -> tuple[torch.Tensor, ...]:
    """hidden [n, h], a padded output weight [V + 3, h], targets, and the weights of logprob and
    entropy in the loss whose gradients are compared."""
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(POSITIONS, HIDDEN, generator=gen), torch.randn(PADDED_VOCAB, HIDDEN, generator=gen),
            torch.randint(0, VOCAB, (POSITIONS,), generator=gen), torch.randn(POSITIONS, generator=gen),
            torch.randn(POSITIONS, generator=gen))


def _fused_output_layer(model, ids: torch.Tensor, tp: int, group) -> dict:
    """trainer.logprob_chunk at this TP: the model's fused output layer (logprobs of the response
    tokens, chunk by chunk of 3 positions), and chunked_logprobs' values and gradients on a
    vocab-parallel weight (3 padding columns) through Megatron's copy to the TP region."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
    )

    from rft.trainer.chunked_logprob import chunked_logprobs
    from rft.trainer.forward import fused_logprobs, model_forward, pack_microbatch

    seqs = ids.tolist()
    mb = pack_microbatch([s[:4] for s in seqs], [s[4:] for s in seqs], 0, torch.device("cpu"))
    with torch.no_grad():
        model_lp, model_ent = fused_logprobs(model_forward(model, mb, response_only=True, fused_chunk=3), mb)
    result = {"model_fused": (model_lp, model_ent, mb.loss_mask)}
    for chunk in (4, POSITIONS):  # three chunks, recomputed in backward; one, kept
        hidden, weight, targets, a, b = chunked_case()
        hidden.requires_grad_(True)
        rows = PADDED_VOCAB // tp
        start = parallel_state.get_tensor_model_parallel_rank() * rows
        local = weight[start:start + rows].clone().requires_grad_(True)
        into = copy_to_tensor_model_parallel_region(hidden) if tp > 1 else hidden
        lp, ent = chunked_logprobs(into, local, targets, vocab_start=start, real_vocab=VOCAB, group=group, chunk=chunk)
        (lp * a + ent * b).sum().backward()
        shards = [torch.empty_like(local.grad) for _ in range(tp)]
        dist.all_gather(shards, local.grad, group=group)
        result[f"chunked_{chunk}"] = (lp.detach(), ent.detach(), hidden.grad, torch.cat(shards))
    return result


def _run(world: int, tp: int, model_dir: str, out: str) -> dict:
    spawn(_worker, world, tp, free_port(), model_dir, out)
    return torch.load(out)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    return create_tiny_model(TinyModelConfig(), str(path), seed=0)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> tuple[dict, dict]:
    """What one rank at TP=1 and rank 0 of two gloo ranks at TP=2 computed."""
    out = tmp_path_factory.mktemp("tp")
    return _run(1, 1, tiny_model, str(out / "tp1.pt")), _run(2, 2, tiny_model, str(out / "tp2.pt"))


def test_tp2_logits_equal_tp1_and_transformers(tiny_model, runs):
    tp1, tp2 = runs
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


def test_the_chunked_output_layer_at_tp2_gives_tp1s_whole_logits_values_and_gradients(runs):
    """trainer.logprob_chunk over a vocabulary split across two gloo ranks: the model's fused
    output layer gives the logprobs and entropy of whole logits, and chunked_logprobs' values and
    gradients (hidden and weight) equal autograd's through whole fp32 logits at TP=1."""
    tp1, tp2 = runs
    response = slice(3, len(SEQUENCES[0]) - 1)  # the response's targets: positions 3.. predict tokens 4..
    for run in (tp1, tp2):
        lp, ent, _ = run["model_fused"]
        assert (lp[:, response] - tp1["logprobs"][:, response]).abs().max() <= 1e-5
        assert (ent[:, response] - tp1["entropy"][:, response]).abs().max() <= 1e-5
        assert (lp[:, :3] == 0).all()  # no logits at the prompt's targets

    hidden, weight, targets, a, b = chunked_case()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logits = (hidden @ weight.t()).masked_fill(torch.arange(PADDED_VOCAB) >= VOCAB, float("-inf"))
    logp = torch.log_softmax(logits[:, :VOCAB], dim=-1)
    lp, ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (lp * a + ent * b).sum().backward()
    for run in (tp1, tp2):
        for chunk in (4, POSITIONS):
            for got, want in zip(run[f"chunked_{chunk}"], (lp, ent, hidden.grad, weight.grad)):
                torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5, msg=f"chunk {chunk}")
    assert tp2["chunked_4"][3][VOCAB:].abs().max() == 0  # the padding columns get no gradient
