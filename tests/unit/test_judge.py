"""Judge engines' client side (rft/explorer/judge.py) against real sockets, and the judge role's
place in the job: a hung judge costs judge.timeout_s and a count; a dead one an error and a count;
calls go to the least busy engine; judge ranks come after the rollout ranks and never vote."""

import asyncio
import importlib
import os
import socket
import threading
import time

import pytest

from rft.config import JudgeConfig, world_size
from rft.config.checks import validate
from rft.explorer.judge import JudgeClient, JudgeEndpoint, JudgeError, JudgeTimeout, _JudgeHandle
from rft.runtime.topology import Topology
from tests.unit.test_config import compose_cfg


def _silent_server() -> tuple[socket.socket, str]:
    """A server that accepts connections and never answers (a hung judge)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}/v1"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed when we leave: connection refused


def test_a_hung_judge_costs_its_timeout_and_a_count():
    importlib.import_module("openai")  # before the clock: its first import took 2-6 s on 2 loaded cores
    server, url = _silent_server()
    client = JudgeClient([JudgeEndpoint(url, "token", "judge")], JudgeConfig(timeout_s=0.5))

    async def ask_many():
        return await client.chat_many([[{"role": "user", "content": f"{i}?"}] for i in range(8)])

    started = time.monotonic()
    replies = asyncio.run(ask_many())
    took = time.monotonic() - started
    server.close()
    assert all(isinstance(r, JudgeTimeout) for r in replies), replies
    assert "did not answer within judge.timeout_s=0.5s" in str(replies[0])
    # concurrent: one timeout for the batch, 0.51-0.55 s measured (2 cores under load), the bound 5 x that;
    # one call after another takes at least 8 x 0.5 = 4 s, over the bound on any machine
    assert took < 3.0, took
    counts = client.take_counts()
    assert (counts.calls, counts.timeouts, counts.errors) == (8, 8, 0)
    assert client.take_counts().calls == 0  # taken once


def test_a_dead_judge_is_an_error_counted_not_a_hang():
    client = JudgeClient([JudgeEndpoint(_closed_port_url(), "token", "judge")], JudgeConfig(timeout_s=5))
    with pytest.raises(JudgeError, match="judge engine 0"):
        asyncio.run(client.complete("2+2="))
    counts = client.take_counts()
    assert (counts.calls, counts.timeouts, counts.errors) == (1, 0, 1)


def test_calls_go_to_the_least_busy_judge():
    servers = [_silent_server() for _ in range(2)]
    client = JudgeClient([JudgeEndpoint(url, "t", "judge") for _, url in servers], JudgeConfig(timeout_s=0.3))
    seen = []

    async def ask():
        calls = [asyncio.create_task(client.complete("x")) for _ in range(6)]
        await asyncio.sleep(0.05)
        seen.append(list(client._in_flight))
        await asyncio.gather(*calls, return_exceptions=True)

    asyncio.run(ask())
    for server, _ in servers:
        server.close()
    assert seen == [[3, 3]]


def test_the_judge_handle_says_how_to_get_a_judge():
    with pytest.raises(JudgeError, match="cluster.judge_ranks=1"):
        _JudgeHandle().chat  # noqa: B018 - the attribute access is what fails


def test_judge_ranks_follow_the_rollout_ranks_and_never_vote(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "cluster.rollout_ranks=2",
                      "cluster.judge_ranks=2")
    validate(cfg)
    assert world_size(cfg) == 5
    infos = [Topology.of(cfg, r) for r in range(5)]
    assert [(i.role, i.role_rank) for i in infos] == [("trainer", 0), ("rollout", 0), ("rollout", 1),
                                                       ("judge", 0), ("judge", 1)]
    assert infos[0].voting_ranks == [0, 1, 2]
    assert [i.member_name(i.rank) for i in infos[3:]] == ["judge rank 3", "judge rank 4"]


@pytest.mark.parametrize("overrides, key", [
    (["+stages.1.algorithm.reward=llm_judge"], r"stages\[grpo\]\.algorithm\.reward.*cluster\.judge_ranks=1"),
    (["cluster.judge_ranks=1", "judge.model=/nonexistent"], r"judge\.model"),
    (["cluster.judge_ranks=1", "judge.timeout_s=0"], r"judge\.timeout_s"),
    (["cluster.judge_ranks=-1"], r"cluster\.judge_ranks"),
])
def test_bad_judge_settings_name_the_key(tmp_path, overrides, key):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match=key):
        validate(cfg)


def _tiny_reward_model(tmp_path) -> str:
    """The tiny policy's architecture with a one-label classification head (a reward model)."""
    import shutil

    import torch
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from rft.config import TinyModelConfig
    from rft.models.tiny import create_tiny_model

    policy = create_tiny_model(TinyModelConfig(), str(tmp_path / "policy"), seed=0)
    config = AutoConfig.from_pretrained(policy)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(policy, name), tmp_path / "rm")
    return str(tmp_path / "rm")


def test_a_reward_model_judge_scores_as_transformers_does(tmp_path):
    """judge.kind=classify: vLLM's pooling runner behind the same server; judge.score matches HF's
    sigmoid of the sequence-classification logit; /classify refuses a call without the token."""
    import httpx
    import torch
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.openai_endpoint import OpenAIEndpoint
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.runtime.topology import free_port

    path = _tiny_reward_model(tmp_path)
    engine = RolloutEngine(ModelConfig(name="rm", path=path), RolloutConfig(kv_cache_gb=0.1), seed=0, max_model_len=64,
                           runner="pooling")
    endpoint = OpenAIEndpoint(engine, "127.0.0.1", free_port(), "secret", served_name="judge")
    endpoint.start()
    try:
        client = JudgeClient([JudgeEndpoint(endpoint.url, "secret", "judge")], JudgeConfig(kind="classify"))
        texts = ["12+34=46", "12+34=99", "7+8=15"]
        scores = asyncio.run(client.score(texts))
        refused = httpx.post(endpoint.url.removesuffix("/v1") + "/classify", json={"model": "judge", "input": texts})
    finally:
        endpoint.close()
        engine.close()
    tokenizer, model = AutoTokenizer.from_pretrained(path), Qwen2ForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]).item() for t in texts]
    assert scores == pytest.approx(expected, abs=1e-4), (scores, expected)
    assert len(set(scores)) == 3
    assert refused.status_code == 401
    assert client.take_counts().calls == 1  # one call for the batch


@pytest.mark.parametrize("token", ["plain_token-1", "-starts_with_a_dash", "--looks-like-an-option"])
def test_any_endpoint_token_reaches_vllms_server_whole(token):
    """The endpoint's random token may start with "-" (token_urlsafe's alphabet has it): vLLM's
    argument parser must still read it as the key, not as an option (a judge rank failed so)."""
    from rft.explorer.openai_endpoint import server_args

    args = server_args("/models/x", token, "judge")
    assert args.api_key == [token] and args.served_model_name == ["judge"]
