"""HF <-> Megatron at TP x PP for Qwen2, Llama (tied), Qwen3 (q/k norms), scaled RoPE (Llama 3.1's
llama3, Qwen2.5's YaRN) and Qwen3-MoE (routed experts, also split over expert-parallel ranks), on
gloo ranks.

Each layout (TP1, TP2, PP2, TP2 x PP2; EP2 for MoE) imports the HF checkpoint, then checks:
  - logits (TP1/TP2) and next-token logprobs (all layouts) equal `transformers`' (<= 1e-4);
  - HF -> Megatron -> HF export is bit-exact;
  - after two SGD steps (pipelined under PP), Megatron -> HF -> Megatron is bit-exact, and the
    exported weights make `transformers` score sequences as the trainer does;
  - every layout trains to the same weights as TP1 (pipeline/tensor parallel gradients agree).
"""

import os

import pytest
import torch
from dist_models import VOCAB, create_family_model, free_port, init_gloo, spawn

SEQUENCES = [[1, 5, 6, 14, 7, 8, 17, 9, 10, 2], [1, 12, 13, 14, 20, 21, 17, 30, 31, 32]]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (TP, PP); MoE's have a third number, EP (its DP is EP)


def _exported(model, geo) -> dict[str, torch.Tensor] | None:
    """HF tensors of this stage (on its TP rank 0), gathered by every TP rank."""
    from megatron.core import parallel_state as ps

    from rft.trainer.hf_weights import export_hf_weights

    tensors = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    return tensors if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else None


def _worker(rank: int, world: int, tp: int, pp: int, ep: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import logprobs_from_logits, model_forward, pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp, ep=ep)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    mb = pack_microbatch([s[:1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], 0, torch.device("cpu"))
    result: dict = {"stage": ps.get_pipeline_model_parallel_rank()}
    # rft.weights.engines.sync_layout picks stage s's sender as rank s x world / pp: Megatron's order agrees
    is_first_of_stage = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    assert is_first_of_stage == (rank % (world // pp) == 0) and rank // (world // pp) == result["stage"]
    with torch.no_grad():
        result["logprobs_before"] = forward_logprobs_pipelined(model, [mb])
        if pp == 1:
            logits = model_forward(model, mb)
            shards = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            result["logits"] = torch.cat(shards, dim=-1)[..., :VOCAB]
            result["logprobs_plain"] = logprobs_from_logits(logits, mb, with_entropy=False)[0]
    result["export_before"] = _exported(model, geo)
    optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.SGD(masters, lr=0.5))
    batch = StepBatch(prompt_ids=[s[:4] for s in SEQUENCES], response_ids=[s[4:] for s in SEQUENCES])
    for _ in range(2):
        train_step(model, optimizer, batch, AlgorithmConfig(name="sft", grad_clip=0.0), 1, 0)
    result["logprobs_after"] = forward_logprobs_pipelined(model, [mb])
    exported = {n: t for n, t in export_hf_weights_all(model, geo)}
    twin, _ = build_gpt_model(model_dir)
    load_hf_weights(twin, exported, geo)  # every rank holds the full HF dict here (tests only)
    result["roundtrip_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    result["export_after"] = _exported(model, geo)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def export_hf_weights_all(model, geo):
    """The whole model's HF tensors on every rank: each stage's export, shared over the PP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.trainer.hf_weights import export_hf_weights

    mine = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
    return [(n, t) for part in parts for n, t in part.items()]


def _run(tp: int, pp: int, model_dir: str, out_dir: str, ep: int = 1) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    spawn(_worker, tp * pp * ep, tp, pp, ep, free_port(), model_dir, out_dir)
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(tp * pp * ep)]
    last = [r for r in ranks if r["stage"] == pp - 1][0]
    merged = {"logprobs_before": last["logprobs_before"][0], "logprobs_after": last["logprobs_after"][0],
              "logits": ranks[0].get("logits"), "logprobs_plain": ranks[0].get("logprobs_plain"),
              "roundtrip_equal": all(r["roundtrip_equal"] for r in ranks), "export_before": {}, "export_after": {}}
    for r in ranks:
        for key in ("export_before", "export_after"):
            if r[key] is not None:
                assert not set(r[key]) & set(merged[key]), "two stages exported the same tensor"
                merged[key].update(r[key])
    return merged


def _hf_logprobs(model_dir: str, state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    if state is not None:  # the exported tensors as a checkpoint, loaded as transformers loads one
        import shutil
        import tempfile

        from safetensors.torch import save_file

        scratch = tempfile.mkdtemp()
        shutil.copy(os.path.join(model_dir, "config.json"), scratch)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(scratch, "model.safetensors"))
        model_dir = scratch
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        shutil.rmtree(model_dir)
    with torch.no_grad():
        logits = hf(torch.tensor(SEQUENCES)).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(SEQUENCES)[:, 1:, None])[..., 0]
    return logits, logp


# the scaled RoPEs change no weight mapping: llama3 at TP x PP besides the reference (every stage
# gets the scaled frequencies), YaRN's and linear scaling at TP1
# every layout once (Qwen2); the other families' rules at TP1 and at TP2 x PP2, which holds both
@pytest.mark.parametrize("family, layouts", [("qwen2", LAYOUTS), ("llama", [(1, 1), (2, 2)]), ("qwen3", [(1, 1), (2, 2)]),
                                             ("llama3", [(1, 1), (2, 2)]), ("qwen2_yarn", [(1, 1)]),
                                             ("llama_linear", [(1, 1)]),
                                             ("qwen3_moe", [(1, 1), (2, 1), (1, 2, 2), (2, 1, 2)])])
def test_hf_megatron_mapping_at_every_layout(family, layouts, tmp_path):
    from safetensors.torch import load_file

    model_dir = create_family_model(family, str(tmp_path / "hf"))
    hf_state = load_file(os.path.join(model_dir, "model.safetensors"))
    hf_logits, hf_logp = _hf_logprobs(model_dir)
    runs = {layout: _run(*layout[:2], model_dir, str(tmp_path / "x".join(map(str, layout))), *layout[2:])
            for layout in layouts}
    reference = runs[(1, 1)]
    for (tp, pp, *ep), run in runs.items():
        where = f"{family} TP{tp} PP{pp}" + (f" EP{ep[0]}" if ep else "")
        assert (run["logprobs_before"] - hf_logp).abs().max() <= 1e-4, where
        if pp == 1:
            assert (run["logits"] - hf_logits).abs().max() <= 1e-4, where
            assert (run["logprobs_plain"] - hf_logp).abs().max() <= 1e-4, where
        assert run["export_before"].keys() == hf_state.keys(), where
        assert all(torch.equal(run["export_before"][k], hf_state[k]) for k in hf_state), where
        assert run["roundtrip_equal"], where
        _, trained_logp = _hf_logprobs(model_dir, run["export_after"])
        assert (run["logprobs_after"] - trained_logp).abs().max() <= 1e-4, where
        assert (trained_logp - hf_logp).abs().max() > 1e-2, f"{where}: training did not move the weights"
        bad = [(k, float((t - reference["export_after"][k]).abs().max())) for k, t in run["export_after"].items()
               if (t - reference["export_after"][k]).abs().max() > 1e-5]
        assert not bad, f"{where}: trains differently: {bad[:8]}"
