"""Sequence parallelism (trainer.sequence_parallel) on gloo ranks: TP=2 with SP, alone and with two
pipeline stages, gives TP=1's policy gradients (norms summed over TP) and the critic's values and
gradients, over microbatches of odd lengths, padded and packed; and it saves fewer activation
bytes for backward than TP=2 without SP."""

import os

import pytest
import torch
from dist_models import LiveActivations, create_family_model, free_port, hf_grads, init_gloo, spawn

LAYOUTS = {"qwen3": [(1, 1, False), (2, 1, True)],  # q/k norms: summed over TP once, not twice
           "llama": [(1, 1, False), (2, 2, True)]}  # tied embedding across two stages


def _microbatches(multiple_of: int, packed: bool):
    from rft.trainer.forward import pack_microbatch

    g = torch.Generator().manual_seed(0)
    mbs = []
    for _ in range(4):
        lengths = [2 + int(torch.randint(0, 8, (1,), generator=g)) for _ in range(3)]
        prompts = [[1] + torch.randint(3, 90, (2,), generator=g).tolist() for _ in lengths]
        responses = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
        mbs.append(pack_microbatch(prompts, responses, 0, torch.device("cpu"), packed=packed,
                                   multiple_of=multiple_of))
    return mbs


def _weights(mb, width: int) -> torch.Tensor:
    """Different weights per target, so a value at the wrong position cannot match (a function of
    the position alone: sequence parallelism pads rows to a multiple of TP)."""
    return mb.loss_mask * torch.cos(torch.arange(width, dtype=torch.float32))


def _policy_loss(m, mb, logprobs, entropy):
    return (logprobs * _weights(mb, logprobs.shape[-1])).sum() * (m + 1) + 0.1 * (entropy * mb.loss_mask).sum()


def _critic_loss(m, mb, values):
    return (values * _weights(mb, values.shape[-1])).sum() * (m + 1)


def _worker(rank: int, world: int, tp: int, pp: int, sp: bool, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.trainer.critic import build_critic_model, values_of
    from rft.trainer.forward import sequence_multiple
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_backward, forward_pipelined

    init_gloo(rank, world, port, tp, pp)
    model, geo = build_gpt_model(model_dir, sequence_parallel=sp)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    critic = build_critic_model(model_dir, "float32", model, seed=0)
    multiple = sequence_multiple(model)
    result = {"multiple": multiple, "tp_rank": ps.get_tensor_model_parallel_rank()}

    def values_head(output, mb):
        return (values_of(output, mb),)

    for packed in (False, True):
        mbs = _microbatches(multiple, packed)
        model.zero_grad()
        forward_backward(model, mbs, _policy_loss)
        result[f"policy{packed}"] = hf_grads(model, geo)
        critic.zero_grad()
        forward_backward(critic, mbs, _critic_loss, head=values_head)
        result[f"critic_head{packed}"] = {n: p.grad.clone() for n, p in critic.named_parameters()
                                          if n.startswith("output_layer.")}
        result[f"values{packed}"] = forward_pipelined(critic, mbs, values_of)
    if tp > 1:  # the same layout without SP, for the bytes autograd keeps for backward
        plain, _ = build_gpt_model(model_dir, sequence_parallel=False)
        load_hf_weights(plain, load_hf_state(model_dir), geo)
        for name, m in (("sp", model), ("plain", plain)):
            memory = LiveActivations()
            with memory.hooks():
                forward_backward(m, _microbatches(sequence_multiple(m), False)[:1], _policy_loss)
            result[f"saved_{name}"] = memory.peak
    torch.save(result, os.path.join(out_dir, f"tp{tp}pp{pp}sp{sp}-rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(f"sp_{family}")
    model_dir = create_family_model(family, str(out / "hf"))
    results = {}
    for tp, pp, sp in LAYOUTS[family]:
        spawn(_worker, tp * pp, tp, pp, sp, free_port(), model_dir, str(out))
        results[(tp, pp, sp)] = [torch.load(out / f"tp{tp}pp{pp}sp{sp}-rank{r}.pt") for r in range(tp * pp)]
    return results


def _split(results):
    (reference,), layout = results[(1, 1, False)], next(k for k in results if k[0] > 1)
    return reference, layout, results[layout]


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_parallel_gives_the_gradients_of_one_rank(runs, packed):
    reference, (tp, _, _), ranks = _split(runs)
    assert all(r["multiple"] == tp for r in ranks)
    seen = {}
    for r in ranks:
        seen.update(r[f"policy{packed}"])  # TP ranks export the same gathered tensors; stages their own
    want = reference[f"policy{packed}"]
    assert seen.keys() == want.keys()
    assert any("norm" in n for n in want) and sum(float(g.abs().sum()) for g in want.values()) > 0
    for name, grad in want.items():
        torch.testing.assert_close(seen[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("packed", [False, True])
def test_the_critic_under_sequence_parallelism_gives_the_values_and_head_gradients_of_one_rank(runs, packed):
    reference, _, ranks = _split(runs)
    last = [r for r in ranks if r[f"values{packed}"] is not None]
    assert last and all(r["tp_rank"] in (0, 1) for r in last)
    for r in last:  # every TP rank of the last stage computes the whole sequence's values
        for got, want in zip(r[f"values{packed}"], reference[f"values{packed}"], strict=True):
            width = want.shape[1]  # padded rows may be longer by the padding to a multiple of TP
            torch.testing.assert_close(got[:, :width], want, atol=1e-5, rtol=1e-4)
        for name, grad in reference[f"critic_head{packed}"].items():
            torch.testing.assert_close(r[f"critic_head{packed}"][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_sequence_parallelism_saves_activation_memory(runs):
    for r in _split(runs)[2]:
        assert r["saved_sp"] < 0.9 * r["saved_plain"], (r["saved_sp"], r["saved_plain"])
