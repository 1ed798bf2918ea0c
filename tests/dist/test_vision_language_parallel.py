"""The Qwen2.5-VL-shaped trainer model (rft/trainer/vision.py) at TP2 x PP2 with sequence
parallelism on gloo ranks, against TP1 and transformers: image prompts score as transformers
scores them, and a training step moves the vision tower and the decoder to the same weights as
at TP1 (the vision tower, whole on each TP rank of the first stage, gets its gradient through the
decoder's input)."""

import os

import torch
from dist_models import free_port, init_gloo, spawn

from tests.unit.test_vision_language import _sequences, model_dir  # noqa: F401  (the tiny VL model fixture)


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, out_dir: str,
            prompts, responses, images) -> None:
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import pack_microbatch, sequence_multiple
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step
    from rft.trainer.vision import mrope_of
    from tests.dist.test_hf_megatron import export_hf_weights_all

    init_gloo(rank, world, port, tp, pp)
    model, geo = build_gpt_model(model_dir, sequence_parallel=tp > 1)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    mb = pack_microbatch(prompts, responses, 0, torch.device("cpu"), multiple_of=sequence_multiple(model),
                         images=images, mrope=mrope_of(model))
    result = {"logprobs": forward_logprobs_pipelined(model, [mb]), "mask": mb.loss_mask}
    optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.SGD(masters, lr=0.5))
    batch = StepBatch(prompt_ids=prompts, response_ids=responses, images=images)
    train_step(model, optimizer, batch, AlgorithmConfig(name="sft", grad_clip=0.0), 3, 0)
    result["trained"] = dict(export_hf_weights_all(model, geo))
    result["last_stage"] = ps.is_pipeline_last_stage()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(tp: int, pp: int, model_dir: str, out_dir: str, sequences) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    spawn(_worker, tp * pp, tp, pp, free_port(), model_dir, out_dir, *sequences)
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(tp * pp)]
    last = next(r for r in ranks if r["last_stage"])
    return {"logprobs": last["logprobs"][0], "mask": last["mask"], "trained": ranks[0]["trained"]}


def test_tp2_pp2_with_sequence_parallel_scores_as_transformers_and_trains_as_tp1(model_dir, tmp_path):  # noqa: F811
    from transformers import Qwen2_5_VLForConditionalGeneration

    sequences = _sequences(model_dir)
    reference, parallel = (_run(tp, pp, model_dir, str(tmp_path / f"tp{tp}pp{pp}"), sequences) for tp, pp in ((1, 1), (2, 2)))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    for row, (p, r, im) in enumerate(zip(*sequences)):
        ids = torch.tensor([p + r])
        kwargs = {} if im is None else {"pixel_values": im.pixel_values, "image_grid_thw": im.grid_thw}
        with torch.no_grad():
            logits = hf(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), **kwargs).logits
        expected = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        targets = parallel["mask"][row].nonzero()[:, 0]
        assert torch.allclose(parallel["logprobs"][row, targets], expected[targets], atol=1e-4), row
    trained, before = reference["trained"], dict(hf.state_dict())
    assert sorted(parallel["trained"]) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.allclose(parallel["trained"][name], tensor, atol=1e-5), name
    # the step moved the vision tower (its patch embedding, first in the tower)
    moved = trained["visual.patch_embed.proj.weight"] - before["model.visual.patch_embed.proj.weight"]
    assert moved.abs().max() > 1e-6
