"""Megatron's 1F1B schedules, as rft/trainer/pipeline.py drives them, on gloo ranks: PP=2 and PP=4,
and PP=2 with two virtual stages each (interleaved; untied and tied embeddings), give the
gradients of PP=1 over eight microbatches of different lengths (packed and padded) and over three
(no multiple of the stages: the interleaved schedule's fillers), and the same forward-only
logprobs; and a non-interleaved stage holds the saved activations of at most P - s microbatches at
once, where every-forward-then-every-backward (GPipe) held all eight."""

import os

import pytest
import torch
from dist_models import LiveActivations, create_family_model, free_port, hf_grads, init_gloo, spawn

MICROBATCHES = 8
ODD = 3  # no multiple of two stages: the interleaved schedule tops it up with a filler


def _microbatches(same_shape: bool, packed: bool):
    from rft.trainer.forward import pack_microbatch

    g = torch.Generator().manual_seed(0)
    mbs = []
    for m in range(MICROBATCHES):
        rows = 2
        lengths = [6] * rows if same_shape else [3 + int(torch.randint(0, 9, (1,), generator=g)) for _ in range(rows)]
        prompts = [[1] + torch.randint(3, 90, (2,), generator=g).tolist() for _ in range(rows)]
        responses = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
        mbs.append(pack_microbatch(prompts, responses, 0, torch.device("cpu"), packed=packed))
    return mbs


def _loss(m, mb, logprobs, _entropy):
    """A loss that weighs every target and microbatch differently, so a gradient from the wrong
    microbatch or position cannot match."""
    return (logprobs * mb.loss_mask * torch.linspace(-1.0, 1.0, logprobs.shape[-1])).sum() * (m + 1)


def _worker(rank: int, world: int, pp: int, vpp: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_backward, forward_logprobs_pipelined

    init_gloo(rank, world, port, 1, pp, vpp)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    result = {"stage": ps.get_pipeline_model_parallel_rank()}
    for packed in (False, True):
        model.zero_grad()
        forward_backward(model, _microbatches(same_shape=False, packed=packed), _loss, with_entropy=False)
        result[f"grads_packed{packed}"] = hf_grads(model, geo)
    # a count that is no multiple of the stages (the interleaved schedule's fillers)
    odd = _microbatches(same_shape=False, packed=False)[:ODD]
    model.zero_grad()
    forward_backward(model, odd, _loss, with_entropy=False)
    result["grads_odd"] = hf_grads(model, geo)
    result["logprobs_odd"] = forward_logprobs_pipelined(model, odd)
    same = _microbatches(same_shape=True, packed=False)
    for count in (1, MICROBATCHES) if vpp == 1 else ():
        memory = LiveActivations()
        with memory.hooks():
            forward_backward(model, same[:count], _loss, with_entropy=False)
        result[f"peak{count}"] = memory.peak
    torch.save(result, os.path.join(out_dir, f"pp{pp}vpp{vpp}-rank{rank}.pt"))
    dist.destroy_process_group()


LAYOUTS = {"qwen2": [(1, 1), (2, 1), (4, 1), (2, 2)],  # (stages, virtual stages)
           "llama": [(1, 1), (2, 2)]}  # tied embedding: chunk 0 of the first stage, the last of the last


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for family, layouts in LAYOUTS.items():
        out = tmp_path_factory.mktemp(f"pipeline_{family}")
        model_dir = create_family_model(family, str(out / "hf"))
        for pp, vpp in layouts:
            spawn(_worker, pp, pp, vpp, free_port(), model_dir, str(out))
            results[family, pp, vpp] = [torch.load(out / f"pp{pp}vpp{vpp}-rank{r}.pt") for r in range(pp)]
    return results


def _assert_same_grads(stages, reference):
    seen = {}
    for stage in stages:
        seen.update(stage)
    assert seen.keys() == reference.keys()
    assert sum(float(g.abs().sum()) for g in reference.values()) > 0
    for name, grad in reference.items():
        torch.testing.assert_close(seen[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family, pp, vpp", [("qwen2", 2, 1), ("qwen2", 4, 1), ("qwen2", 2, 2), ("llama", 2, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_1f1b_gives_the_gradients_of_one_stage(runs, family, pp, vpp, packed):
    key = f"grads_packed{packed}"
    _assert_same_grads([stage[key] for stage in runs[family, pp, vpp]], runs[family, 1, 1][0][key])


@pytest.mark.parametrize("family, pp, vpp", [("qwen2", 2, 1), ("qwen2", 2, 2), ("llama", 2, 2)])
def test_a_microbatch_count_off_the_stage_count_gives_the_gradients_and_logprobs_of_one_stage(runs, family, pp, vpp):
    reference = runs[family, 1, 1][0]
    _assert_same_grads([stage["grads_odd"] for stage in runs[family, pp, vpp]], reference["grads_odd"])
    last = runs[family, pp, vpp][-1]["logprobs_odd"]
    assert len(last) == ODD and all(r["logprobs_odd"] is None for r in runs[family, pp, vpp][:-1])
    for got, want in zip(last, reference["logprobs_odd"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_stage_holds_at_most_its_distance_to_the_end_in_microbatches(runs, pp):
    for result in runs["qwen2", pp, 1]:
        one, eight = result["peak1"], result[f"peak{MICROBATCHES}"]
        held = pp - result["stage"]  # warm-up forwards + the one in flight
        assert one > 0
        assert eight <= held * one * 1.01, (result["stage"], eight / one)
        assert eight >= min(held, MICROBATCHES) * one * 0.99, (result["stage"], eight / one)
