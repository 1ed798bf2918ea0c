"""vLLM's own OpenAI server on a real rollout engine (rft/explorer/openai_endpoint.py): an agent in
another process drives the policy with the real `openai` client over HTTP; its sessions are
recorded with vLLM's sampled ids and logprobs and become experience once it posts a reward."""

import json
import secrets
import subprocess
import sys
import textwrap

import pytest

from rft.cluster import free_port

AGENT = textwrap.dedent("""
    import json, sys
    import httpx
    from openai import OpenAI

    url, token = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=url, api_key=token)
    turns = []
    for session in ("a", "b"):          # two sessions of one task: one group for GRPO's baseline
        headers = {"X-RFT-Session": session, "X-RFT-Group": "task-7"}
        prompt = "12+34="
        for turn in range(2):           # a two-turn agent: the second prompt extends the first
            out = client.completions.create(model="policy", prompt=prompt, max_tokens=4, temperature=1.0,
                                            seed=turn, extra_headers=headers,
                                            extra_body={"return_token_ids": True})
            choice = out.choices[0]
            turns.append({"session": session, "prompt_ids": choice.prompt_token_ids,
                          "token_ids": choice.token_ids, "text": choice.text})
            prompt = prompt + choice.text + " again "
        reward = httpx.post(url.removesuffix("/v1") + f"/rft/v1/sessions/{session}/reward",
                            json={"reward": 1.0 if session == "a" else 0.0},
                            headers={"Authorization": f"Bearer {token}"})
        reward.raise_for_status()
    client.completions.create(model="policy", prompt="1+1=", max_tokens=2)  # no session: not recorded
    try:
        OpenAI(base_url=url, api_key="wrong").completions.create(model="policy", prompt="1", max_tokens=1)
        turns.append("served a wrong token")
    except Exception as err:
        turns.append(type(err).__name__)
    bad = httpx.post(url.removesuffix("/v1") + "/rft/v1/sessions/a/reward", json={"reward": 5})
    turns.append(bad.status_code)
    print(json.dumps(turns))
""")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rft.config import ModelConfig, RolloutConfig, TinyModelConfig
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.models.tiny import create_tiny_model

    path = create_tiny_model(TinyModelConfig(), str(tmp_path_factory.mktemp("tiny")), seed=0)
    engine = RolloutEngine(ModelConfig(name="tiny", path=path), RolloutConfig(kv_cache_gb=0.1), seed=0,
                           max_model_len=64)
    yield engine
    engine.close()


def test_an_external_agents_sessions_become_experience(engine):
    from rft.explorer.openai_endpoint import OpenAIEndpoint, session_experiences

    token = secrets.token_hex(16)
    endpoint = OpenAIEndpoint(engine, "127.0.0.1", free_port(), token)
    endpoint.start()
    engine.version = 3  # the weights version the calls are served with
    try:
        agent = subprocess.run([sys.executable, "-c", AGENT, endpoint.url, token], capture_output=True, text=True,
                               timeout=300)
    finally:
        endpoint.close()
    assert agent.returncode == 0, agent.stderr[-3000:]
    *turns, wrong_token, unauthorised_reward = json.loads(agent.stdout.splitlines()[-1])
    assert wrong_token == "AuthenticationError" and unauthorised_reward == 401

    sessions = sorted(endpoint.sessions.take_rewarded(), key=lambda s: s.id)
    assert [(s.id, s.group, s.reward, len(s.calls)) for s in sessions] == [("a", "task-7", 1.0, 2),
                                                                            ("b", "task-7", 0.0, 2)]
    assert endpoint.sessions.open_sessions() == 0  # the session-less call was served, not recorded
    for session in sessions:
        calls = [t for t in turns if t["session"] == session.id]
        for recorded, seen in zip(session.calls, calls):  # exactly what the agent was served
            assert recorded.prompt_ids == seen["prompt_ids"] and recorded.token_ids == seen["token_ids"]
            assert len(recorded.logprobs) == len(recorded.token_ids) and all(lp <= 0 for lp in recorded.logprobs)
            assert recorded.version == 3
        rows = session_experiences(session)
        for row in rows:
            row.check()
            assert (row.group_id, row.trajectory_id, row.reward, row.version) == ("task-7", session.id,
                                                                                   session.reward, 3)
        sampled = [tok for row in rows for tok, m in zip(row.token_ids, row.loss_mask) if m]
        assert sampled == [tok for call in session.calls for tok in call.token_ids]  # trained: only sampled ids
        if len(rows) == 1:  # the second prompt continued the first call's ids: one row, two turns
            assert rows[0].turns == 2 and rows[0].token_ids[:len(calls[1]["prompt_ids"])] == calls[1]["prompt_ids"]
        else:  # the server re-tokenized the appended text differently: the second call is a row of its own
            assert [r.token_ids[:r.prompt_length] for r in rows] == [c["prompt_ids"] for c in calls]


def test_a_request_in_flight_finishes_on_the_weights_it_started_with(engine, tmp_path):
    """A weight update while an agent's request is generating: the request completes on the old
    weights (its logprobs are the old model's), the update is loaded after it."""
    import glob
    import os
    import threading

    import torch
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams

    (original,) = glob.glob(os.path.join(engine.llm.model_config.model, "*.safetensors"))
    weights = load_file(original)
    torch.manual_seed(0)
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    prompt = [5, 6, 14, 7, 8, 17]
    params = SamplingParams(n=48, max_tokens=50, temperature=1.0, ignore_eos=True, seed=1)
    result = {}
    request = threading.Thread(target=lambda: result.update(out=engine.run(engine.generate(prompt, params))))
    request.start()
    while engine.in_flight == 0:
        pass
    engine.load_hf_dir(str(tmp_path))  # blocks until the request has drained and the update is loaded
    assert engine.in_flight == 0  # the request was done generating before the update returned
    request.join()
    samples = result["out"][:4]
    after = [engine.prompt_logprobs([prompt + c.token_ids])[0][-len(c.token_ids):] for c in samples]
    engine.load_hf_dir(os.path.dirname(original))
    before = [engine.prompt_logprobs([prompt + c.token_ids])[0][-len(c.token_ids):] for c in samples]
    for sample, old, new in zip(samples, before, after):
        assert max(abs(a - b) for a, b in zip(sample.logprobs, old)) < 1e-3  # sampled by the old weights
        assert max(abs(a - b) for a, b in zip(sample.logprobs, new)) > 1e-2  # not by the new ones
