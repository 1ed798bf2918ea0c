"""Routing replay (R3) on gloo ranks: a Qwen3-MoE trainer's routers take given experts per token.

Routes come from `transformers` (its router's top k for each token, as vLLM would return them)
and from a shifted copy (every token sent to other experts). At TP1 (padded microbatches), TP2
(sequence parallel), PP2 and EP2 (packed ones):
  - replaying transformers' own routes changes nothing (the routes reach each token in the
    order its router sees them: position-major, packed, sliced per TP rank, per stage);
  - replaying the shifted routes changes the logprobs, identically in every layout (the same
    routes reached the same tokens);
  - a train step with replayed routes runs and the routes are released afterwards.
"""


import numpy as np
import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

SEQUENCES = [[1, 5, 6, 14, 7, 8, 17, 9, 10, 2], [1, 12, 13, 14, 20, 21, 17], [1, 30, 31, 32, 33]]
# TP PP EP packed. Padded microbatches' position-major order is held at TP1; the SP slice at TP2
# packed (a wrong slice fails it as it fails TP2 padded)
LAYOUTS = [(1, 1, 1, False), (1, 2, 1, True), (1, 1, 2, True), (2, 1, 1, True)]


def _hf_routes(model_dir: str) -> list[np.ndarray]:
    """[tokens, layers, k] per sequence: transformers' top-k experts (0s in the dense layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    moe_layers = [i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers]
    routes = []
    for seq in SEQUENCES:
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_router_logits=True)
        per_token = np.zeros((len(seq), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.uint8)
        for layer, logits in zip(moe_layers, out.router_logits):
            per_token[:, layer] = logits.softmax(-1).topk(config.num_experts_per_tok, dim=-1).indices.numpy()
        routes.append(per_token)
    return routes


def _worker(rank: int, world: int, tp: int, pp: int, ep: int, packed: bool, port: int, model_dir: str,
            routes: list, out: str) -> None:
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import pack_microbatch, sequence_multiple
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.moe import routers
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp, ep=ep)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    shifted = [(r + 1) % geo.num_experts for r in routes]
    prompts, responses = [s[:3] for s in SEQUENCES], [s[3:] for s in SEQUENCES]

    def logprobs(replayed):
        mb = pack_microbatch(prompts, responses, 0, torch.device("cpu"), packed=packed,
                             multiple_of=sequence_multiple(model), routes=replayed)
        with torch.no_grad():
            return forward_logprobs_pipelined(model, [mb])

    result = {name: logprobs(r) for name, r in (("chosen", None), ("own", routes), ("shifted", shifted))}
    batch = StepBatch(prompt_ids=prompts, response_ids=responses, expert_routes=shifted)
    result["train"] = train_step(model, build_optimizer(model, lr=1e-2), batch, AlgorithmConfig(name="sft"),
                                 micro_batch_size=2, pad_id=0, max_tokens_per_microbatch=64 if packed else 0)
    result["released"] = all(r.router_replay.router_replay_action is None and r.router_replay.target_topk_idx is None
                             for r in routers(model))
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(result, out)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("replay")
    model_dir = create_family_model("qwen3_moe", str(tmp / "model"))
    routes = _hf_routes(model_dir)
    results = {}
    for layout in LAYOUTS:
        tp, pp, ep, packed = layout
        out = str(tmp / f"{tp}{pp}{ep}{packed}.pt")
        spawn(_worker, tp * pp * ep, tp, pp, ep, packed, free_port(), model_dir, routes, out)
        results[layout] = torch.load(out)
    return results


def _rows(logprobs: list) -> torch.Tensor:
    return torch.cat([lp.reshape(-1) for lp in logprobs])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "tp{}_pp{}_ep{}_{}".format(
    *layout[:3], "packed" if layout[3] else "padded"))
def test_replayed_routes_reach_each_token(replayed, layout):
    result, reference = replayed[layout], replayed[LAYOUTS[0]]
    chosen, own, shifted = (_rows(result[k]) for k in ("chosen", "own", "shifted"))
    assert (own - chosen).abs().max() <= 1e-5  # its own routes, replayed: the same forward
    assert (shifted - chosen).abs().max() > 1e-2  # other experts: another forward ...
    assert (shifted - _rows(reference["shifted"])).abs().max() <= 1e-5  # ... the same in every layout
    assert result["released"] and np.isfinite(result["train"]["loss/policy"])


def test_microbatch_routes_follow_the_routers_token_order():
    """Padded [b, s] microbatches reach a router position-major ([s, b] flattened); packed ones in
    row order; positions without a route get experts 0..k-1."""
    from rft.trainer.routing_replay import microbatch_routes

    a = np.array([[[3, 1]], [[2, 0]]])  # 2 tokens, 1 layer, k=2
    b = np.array([[[1, 2]]])
    padded = microbatch_routes([a, b], [3, 2], 4, packed=False, device=torch.device("cpu"))
    assert padded.shape == (1, 8, 2)
    # position 0: a, b; position 1: a, b's missing second token; then fillers
    assert padded[0, :4].tolist() == [[3, 1], [1, 2], [2, 0], [0, 1]]
    assert padded[0, 4:].tolist() == [[0, 1]] * 4
    packed = microbatch_routes([a, b], [3, 2], 6, packed=True, device=torch.device("cpu"))
    assert packed[0].tolist() == [[3, 1], [2, 0], [0, 1], [1, 2], [0, 1], [0, 1]]




def test_routing_replay_on_a_cpu_rollout_rank_is_refused_naming_the_key(tmp_path):
    """vLLM 0.32 returns routed experts only through its GPU model runner: a CPU rollout rank
    says so before starting an engine."""
    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine

    with pytest.raises(ValueError, match="trainer.routing_replay=rollout") as err:
        RolloutEngine(ModelConfig(name="moe", path=str(tmp_path)), RolloutConfig(), seed=0, max_model_len=64,
                      return_routed_experts=True)
    assert "use trainer.routing_replay=none on CPU" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM returns routed experts on GPUs only")
def test_vllm_returns_the_routes_the_trainer_replays(tmp_path):
    """The GPU path: vLLM (Model Runner V2) returns a route for every token it ran, [prompt +
    sampled - 1, layers, k], in the experts' numbering transformers' router uses."""
    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine

    model_dir = create_family_model("qwen3_moe", str(tmp_path / "model"))
    engine = RolloutEngine(ModelConfig(name="moe", path=model_dir, dtype="float32"),
                           RolloutConfig(gpu_memory_utilization=0.3), seed=0, max_model_len=64,
                           return_routed_experts=True)
    from vllm import SamplingParams

    try:
        prompt = SEQUENCES[0][:4]
        completion = engine.run(engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=0)))[0]
    finally:
        engine.close()
    routes = completion.routed_experts
    tokens = len(prompt) + len(completion.token_ids) - 1
    assert routes is not None and routes.shape[0] >= tokens and routes.shape[1:] == (4, 2)
    SEQUENCES.append(prompt + completion.token_ids)  # transformers' routes for the same tokens
    try:
        hf = _hf_routes(model_dir)[-1]
    finally:
        SEQUENCES.pop()
    moe = [0, 2, 3]  # layer 1 is dense
    same = np.sort(routes[:tokens, moe], -1) == np.sort(hf[:tokens, moe], -1)
    assert same.mean() >= 0.9  # near ties may flip between kernels: that is what replay is for
