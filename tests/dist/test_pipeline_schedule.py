"""Megatron's 1F1B schedule, as rft/trainer/pipeline.py drives it, on gloo ranks: PP=2 and PP=4 give the
gradients of PP=1 over eight microbatches of different lengths (packed and padded), and a stage
holds the saved activations of at most P - s microbatches at once, where every-forward-then-
every-backward (GPipe) held all eight."""

import os

import pytest
import torch
from dist_models import LiveActivations, create_family_model, free_port, init_gloo, spawn

MICROBATCHES = 8


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


def _worker(rank: int, world: int, pp: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_backward
    from rft.weights.convert import export_hf_weights, load_hf_weights

    init_gloo(rank, world, port, 1, pp)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    result = {"stage": ps.get_pipeline_model_parallel_rank()}
    for packed in (False, True):
        model.zero_grad()
        forward_backward(model, _microbatches(same_shape=False, packed=packed), _loss, with_entropy=False)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # the gradients, HF-named through the weights' exporter
            for n, p in model.named_parameters():
                p.copy_(p.grad)
            # cloned: at TP=1 an exported tensor can be a view of the parameter, restored below
            result[f"grads_packed{packed}"] = {n: t.clone() for n, t in export_hf_weights(model, geo)}
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    same = _microbatches(same_shape=True, packed=False)
    for count in (1, MICROBATCHES):
        memory = LiveActivations()
        with memory.hooks():
            forward_backward(model, same[:count], _loss, with_entropy=False)
        result[f"peak{count}"] = memory.peak
    torch.save(result, os.path.join(out_dir, f"pp{pp}-rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    model_dir = create_family_model("qwen2", str(out / "hf"))
    for pp in (1, 2, 4):
        spawn(_worker, pp, pp, free_port(), model_dir, str(out))
    return {pp: [torch.load(out / f"pp{pp}-rank{r}.pt") for r in range(pp)] for pp in (1, 2, 4)}


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_1f1b_gives_the_gradients_of_one_stage(runs, pp, packed):
    reference = runs[1][0][f"grads_packed{packed}"]
    seen = {}
    for stage in runs[pp]:
        seen.update(stage[f"grads_packed{packed}"])
    assert seen.keys() == reference.keys()
    assert sum(float(g.abs().sum()) for g in reference.values()) > 0
    for name, grad in reference.items():
        torch.testing.assert_close(seen[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_stage_holds_at_most_its_distance_to_the_end_in_microbatches(runs, pp):
    for result in runs[pp]:
        one, eight = result["peak1"], result[f"peak{MICROBATCHES}"]
        held = pp - result["stage"]  # warm-up forwards + the one in flight
        assert one > 0
        assert eight <= held * one * 1.01, (result["stage"], eight / one)
        assert eight >= min(held, MICROBATCHES) * one * 0.99, (result["stage"], eight / one)
