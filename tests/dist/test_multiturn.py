"""Multi-turn experience end to end: a real vLLM engine plays the grid world for 3 model turns
through the multi_turn workflow; the Megatron trainer (a gloo rank) then scores exactly the tokens
vLLM sampled with vLLM's logprobs, and a real optimizer step sends no gradient through the tokens
the policy did not sample (the prompt, the environment's observations)."""

import os
import pickle

import torch
from dist_models import free_port, init_gloo, spawn

TURNS = 3


def _trainer(rank: int, world: int, model_dir: str, experiences_path: str, out: str, port: int) -> None:
    from rft.config import AlgorithmConfig
    from rft.trainer.forward import forward_logprobs, pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp=1, pp=1)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    with open(experiences_path, "rb") as f:
        experiences = pickle.load(f)
    batch = StepBatch.from_experiences(experiences)
    mb = pack_microbatch(batch.prompt_ids, batch.response_ids, 0, torch.device("cpu"),
                         [batch.mask_of(i) for i in range(len(batch.response_ids))])
    with torch.no_grad():
        logprobs, _ = forward_logprobs(model, mb)
    # the logits' gradient during a real optimizer step (GRPO, as the quickstart trains)
    grads = []

    def keep_logits_grad(module, inputs, output) -> None:  # returns None: the output stays as it is
        output[0].register_hook(grads.append)

    model.output_layer.register_forward_hook(keep_logits_grad)
    optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.SGD(masters, lr=0.1))
    train_step(model, optimizer, batch, AlgorithmConfig(), micro_batch_size=len(experiences), pad_id=0)
    torch.save({"logprobs": logprobs, "mask": mb.loss_mask, "grad": grads[0], "targets": mb.response_targets,
                "width": mb.input_ids.shape[1]}, out)


def test_trainer_scores_vllm_sampled_turns_and_observations_get_no_gradient(tmp_path):
    from rft.config import ModelConfig, RolloutConfig, TinyModelConfig
    from rft.data.taskset import Task
    from rft.explorer.model_client import Sampling
    from rft.explorer.runner import WorkflowRunner
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.models.tiny import create_tiny_model

    model_dir = create_tiny_model(TinyModelConfig(max_position_embeddings=128), str(tmp_path / "model"), seed=0)
    rollout = RolloutConfig(kv_cache_gb=0.1, workflow="multi_turn", env="grid_world", max_turns=TURNS, max_new_tokens=4)
    engine = RolloutEngine(ModelConfig(name="tiny", path=model_dir), rollout, seed=0, max_model_len=128)
    # opposite corners: no 3 moves reach the goal, so every episode runs all 3 turns
    tasks = [Task(i, None, None, row={"start": [0, 0], "goal": [4, 4]}) for i in range(4)]
    runner = WorkflowRunner([engine], rollout, "exact_match", False, str(tmp_path / "failed.jsonl"))
    outcome = runner.run(tasks, 2, Sampling(temperature=1.0, max_new_tokens=4), (0,), "mt")
    runner.close()
    engine.close()
    experiences = outcome.experiences
    assert outcome.failed == 0 and len(experiences) == 8
    assert all(e.turns == TURNS and e.finish_reason == "max_turns" for e in experiences)
    for e in experiences:
        e.reward = float(e.trajectory_id.endswith("0"))  # mixed rewards per group: a gradient to check
    with open(tmp_path / "experiences.pkl", "wb") as f:
        pickle.dump(experiences, f)

    out = str(tmp_path / "trainer.pt")
    spawn(_trainer, 1, model_dir, str(tmp_path / "experiences.pkl"), out, free_port())
    result = torch.load(out)
    compared = 0
    for row, e in enumerate(experiences):
        sampled = [t for t, m in enumerate(e.loss_mask) if m]
        # model turns interleave with observations: the mask has holes after the prompt
        assert len(sampled) < len(e.token_ids) - e.prompt_length
        for t in sampled:  # target index t - 1 predicts token t
            assert result["mask"][row, t - 1] == 1
            assert abs(float(result["logprobs"][row, t - 1]) - e.logprobs[t]) < 1e-3, (row, t)
            compared += 1
        unsampled = [t for t in range(1, len(e.token_ids)) if not e.loss_mask[t]]
        assert all(result["mask"][row, t - 1] == 0 for t in unsampled)
    assert compared >= 8 * TURNS
    # logits exist at the response targets alone ([targets, 1, vocab], row-major positions), and
    # the observations between the model's turns, though computed, get no gradient
    grad, targets = result["grad"][:, 0], result["targets"]
    rows, positions = targets // result["width"], targets % result["width"]
    sampled = result["mask"][rows, positions] == 1
    assert sampled.any() and not sampled.all()
    assert torch.count_nonzero(grad[~sampled]) == 0, "tokens the policy did not sample got gradient"
    assert all(torch.count_nonzero(g) > 0 for g in grad[sampled])
    os.remove(out)
