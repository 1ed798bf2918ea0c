"""The Qwen2.5-VL-shaped trainer model (rft/trainer/vision.py) at TP2 x PP2 with sequence
parallelism on gloo ranks, against TP1 and transformers: image prompts score as transformers
scores them, and a training step moves the vision tower and the decoder to the same weights as
at TP1 (the vision tower, whole on each TP rank of the first stage, gets its gradient through the
decoder's input)."""

import os

import torch
from dist_models import free_port, init_gloo, spawn

from tests.unit.test_vision_language import _encoded, _sequences, model_dir  # noqa: F401  (the tiny VL model fixture)


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, out_dir: str,
            prompts, responses, images, pictures) -> None:
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
    batch = StepBatch(prompt_ids=prompts, response_ids=responses, images=_encoded(pictures))
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

    sequences = _sequences(model_dir, with_pictures=True)
    reference, parallel = (_run(tp, pp, model_dir, str(tmp_path / f"tp{tp}pp{pp}"), sequences) for tp, pp in ((1, 1), (2, 2)))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    for row, (p, r, im, _) in enumerate(zip(*sequences)):
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


def _trainer(rank: int, world: int, cfg, port: int, out: str, prompts, responses, images, pictures) -> None:
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
    from rft.trainer.vision import mrope_of
    from tests.dist.test_weight_sync import _info

    init_gloo(rank, world, port, cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size)
    model, geo = build_gpt_model(cfg.model.path)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    optimizer = build_optimizer(model, lr=1e-2)
    batch = StepBatch(prompt_ids=prompts, response_ids=responses, images=_encoded(pictures))
    for _ in range(3):  # real optimizer steps move the weights, the vision tower's too, away from the checkpoint
        train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), micro_batch_size=3, pad_id=0)
    mb = pack_microbatch(prompts, responses, 0, torch.device("cpu"), images=images, mrope=mrope_of(model))
    logprobs = forward_logprobs_pipelined(model, [mb])
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"logprobs": logprobs[0], "mask": mb.loss_mask}, out)
    WeightPublisher(cfg, _info(cfg, rank, port + 10), geo).publish(model, 7)


def test_a_tp2_trainer_syncs_a_vision_language_model_into_vllm_which_then_scores_image_prompts_alike(
        model_dir, tmp_path):  # noqa: F811
    """Weight sync parity into vLLM's CPU build (over gloo), vision tower included: after the
    trainer's steps and one sync, vLLM's logprobs of image prompts equal the trainer's and differ
    from the checkpoint's."""
    import multiprocessing

    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.weights.engines import sync_layout
    from tests.dist.test_weight_sync import _config, _info

    prompts, responses, images, pictures = _sequences(model_dir, with_pictures=True)
    cfg = _config(model_dir, str(tmp_path / "run"), 2, 1, 1, "gloo")
    engine = RolloutEngine(ModelConfig(name="tiny-vl", path=model_dir), RolloutConfig(kv_cache_gb=0.1),
                           seed=0, max_model_len=64)
    from rft.data.images import narrow

    # vLLM is given one <|image_pad|> per image and widens it as the trainer's sequences are widened
    narrowed = [narrow(p + r, engine.image_pad, len(pics)) for p, r, pics in zip(prompts, responses, pictures)]
    before = engine.prompt_logprobs(narrowed, pictures)
    port, out = free_port(), str(tmp_path / "trainer.pt")
    trainer = multiprocessing.get_context("spawn").Process(
        target=spawn, args=(_trainer, 2, cfg, port, out, prompts, responses, images, pictures))
    trainer.start()
    try:
        engine.open_weight_receiver(sync_layout(cfg, _info(cfg, 2, port + 10), False), 0)
        engine.receive_weights()
        trainer.join(timeout=300)
        assert trainer.exitcode == 0
        after = engine.prompt_logprobs(narrowed, pictures)
    finally:
        engine.close()
    trained = torch.load(out)
    for row, (b, a) in enumerate(zip(before, after)):
        assert len(a) == len(prompts[row] + responses[row]) - 1  # vLLM widened the image as the trainer did
        expected = trained["logprobs"][row, : len(a)]
        mask = trained["mask"][row, : len(a)].bool()
        assert (torch.tensor(a)[mask] - expected[mask]).abs().max().item() <= 1e-3, row
        assert (torch.tensor(b)[mask] - expected[mask]).abs().max().item() > 1e-2, row


def _score_experiences(rank: int, world: int, model_dir: str, port: int, out: str, table) -> None:
    from rft.buffer.experience import from_table
    from rft.trainer.forward import pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.vision import image_inputs, mrope_of

    init_gloo(rank, world, port, 1, 1)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    batch = StepBatch.from_experiences(from_table(table))
    mb = pack_microbatch(batch.prompt_ids, batch.response_ids, 0, torch.device("cpu"),
                         images=[image_inputs(model, row) if row else None for row in batch.images], mrope=mrope_of(model))
    torch.save({"logprobs": forward_logprobs_pipelined(model, [mb])[0], "mask": mb.loss_mask}, out)


def test_a_rollout_of_an_image_task_lands_in_experience_that_the_trainer_scores_as_vllm_sampled(model_dir, tmp_path):  # noqa: F811
    """The path an image takes in a run: a task's image and placeholder, a conversation that widens
    it and gives vLLM the image, experience rows (through a shard's table) holding the widened ids
    and the encoded image, and the trainer re-cutting that image into patches: its logprobs of the
    sampled tokens equal vLLM's."""
    from rft.buffer.experience import to_table
    from rft.config import ModelConfig, RolloutConfig
    from rft.data.chat_format import chat_format
    from rft.data.images import PLACEHOLDER
    from rft.explorer.model_client import ModelClient, Sampling
    from rft.explorer.vllm_engine import LoopThread, RolloutEngine

    _, _, _, pictures = _sequences(model_dir, with_pictures=True)
    encoded = _encoded(pictures)
    engine = RolloutEngine(ModelConfig(name="tiny-vl", path=model_dir), RolloutConfig(kv_cache_gb=0.1),
                           seed=0, max_model_len=64)
    try:
        client = ModelClient(engine, chat_format(engine.tokenizer, False), Sampling(max_new_tokens=6), seed=3)
        experiences = []
        for row in (0, 1):  # two image sizes: 4 and 8 image tokens
            convo = client.conversation([{"role": "user", "content": PLACEHOLDER + "colour?"}], tuple(encoded[row]))
            branches = engine.run(convo.replies(2))
            experiences += [b.experience(reward=1.0) for b in branches]
    finally:
        engine.close()
    pad = engine.image_pad
    assert [e.token_ids[: e.prompt_length].count(pad) for e in experiences] == [4, 4, 8, 8]
    assert all(e.images == encoded[i // 2] for i, e in enumerate(experiences))
    out = str(tmp_path / "scored.pt")
    spawn(_score_experiences, 1, model_dir, free_port(), out, to_table(experiences))
    scored = torch.load(out)
    for row, e in enumerate(experiences):
        sampled = torch.tensor(e.logprobs[e.prompt_length:])
        ours = scored["logprobs"][row][scored["mask"][row].bool()]
        assert len(ours) == len(sampled) and (ours - sampled).abs().max() <= 1e-3, (row, ours, sampled)
    del LoopThread


class LookAgainEnv:
    """An environment whose observations are images: a PIL picture at reset, a numpy array after
    the model's first turn (marked inside the text), done after the second."""

    def reset(self, *, seed=None, options=None):
        from tests.unit.test_vision_language import _image

        self.turns = 0
        return {"text": "colour?", "images": [_image(56, 56, "red")]}, {}

    def step(self, action):
        import numpy as np

        from tests.unit.test_vision_language import _image

        self.turns += 1
        if self.turns == 2:
            return "", 1.0, True, False, {}
        return {"text": "and <image> this?", "image": np.asarray(_image(112, 56, "blue"))}, 0.0, False, False, {}

    def close(self):
        pass


def test_an_environment_that_answers_with_images_trains_on_what_vllm_sampled_after_each(model_dir, tmp_path):  # noqa: F811
    """A multi-turn episode whose environment shows the model an image at the start and another
    after its first turn: the conversation widens each where it arrives and vLLM gets both, the
    experience keeps both in order, step_wise's first step only the first, and the trainer scores
    every sampled token of both turns (the second after the second image) as vLLM sampled it."""
    from rft.buffer.experience import to_table
    from rft.config import ModelConfig, RolloutConfig
    from rft.data.chat_format import chat_format
    from rft.data.taskset import Task
    from rft.explorer.model_client import ModelClient, Sampling
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.explorer.workflows.multi_turn import multi_turn
    from rft.explorer.workflows.registry import WorkflowContext
    from rft.explorer.workflows.step_wise import step_wise

    engine = RolloutEngine(ModelConfig(name="tiny-vl", path=model_dir),
                           RolloutConfig(kv_cache_gb=0.1, images_per_prompt=2), seed=0, max_model_len=96)
    try:
        client = ModelClient(engine, chat_format(engine.tokenizer, False), Sampling(max_new_tokens=5), seed=3)
        ctx = WorkflowContext(env=LookAgainEnv, max_turns=3)
        task = Task(index=0, prompt=None, answer=None)
        whole = engine.run(multi_turn(task, client, ctx))
        steps = engine.run(step_wise(task, client, ctx))
    finally:
        engine.close()
    pad = engine.image_pad
    assert whole.turns == 2 and len(whole.images) == 2 and whole.token_ids.count(pad) == 4 + 8
    second = whole.token_ids.index(pad, whole.token_ids.index(pad) + 4)
    assert whole.loss_mask[second - 1] == 0 and 1 in whole.loss_mask[whole.prompt_length:second]
    assert [len(s.images) for s in steps] == [1, 2] and steps[0].images == whole.images[:1]
    # the policy never samples the image token (it would take the second image's place)
    assert [s.token_ids.count(pad) for s in steps] == [4, 12]
    rows = [whole] + steps
    out = str(tmp_path / "scored.pt")
    spawn(_score_experiences, 1, model_dir, free_port(), out, to_table(rows))
    scored = torch.load(out)
    for row, e in enumerate(rows):  # the helper scores every response token; the model's are compared
        sampled = torch.tensor([lp for lp, m in zip(e.logprobs, e.loss_mask) if m])
        ours = scored["logprobs"][row][scored["mask"][row].bool()][torch.tensor(e.loss_mask[e.prompt_length:]).bool()]
        assert len(ours) == len(sampled) and (ours - sampled).abs().max() <= 1e-3, (row, ours, sampled)
