"""vLLM's own OpenAI server on a real rollout engine (rft/explorer/openai_endpoint.py): an agent in
another process drives the policy with the real `openai` client over HTTP; its sessions are
recorded with vLLM's sampled ids and logprobs and become experience once it posts a reward."""

import json
import secrets
import subprocess
import sys
import textwrap

import pytest

from rft.runtime.topology import free_port

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
    streamed = client.completions.create(model="policy", prompt="5+6=", max_tokens=4, stream=True,
                                         extra_headers={"X-RFT-Session": "streamed"})
    turns.append({"session": "streamed", "text": "".join(chunk.choices[0].text for chunk in streamed)})
    reward = httpx.post(url.removesuffix("/v1") + "/rft/v1/sessions/streamed/reward", json={"reward": 0.5},
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
    streamed = sessions.pop()  # a streamed call is recorded whole: the concatenation of its chunks
    assert (streamed.id, streamed.reward, len(streamed.calls)) == ("streamed", 0.5, 1)
    assert streamed.calls[0].text == turns.pop()["text"]
    assert 1 <= len(streamed.calls[0].token_ids) == len(streamed.calls[0].logprobs) <= 4
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


RUN_AGENT = textwrap.dedent("""
    import json, sys, time
    import httpx
    from openai import OpenAI

    run_dir = sys.argv[1]
    endpoints = json.load(open(run_dir + "/endpoints.json"))
    url, token = endpoints["endpoints"][0]["url"], endpoints["token"]
    client = OpenAI(base_url=url, api_key=token)

    def session(name, reward):
        prompt = "23+45="
        for turn in range(2):
            out = client.completions.create(model=endpoints["model"], prompt=prompt, max_tokens=3,
                                            temperature=1.0, extra_headers={"X-RFT-Session": name,
                                                                            "X-RFT-Group": "agent-task"})
            prompt += out.choices[0].text + " and "
        httpx.post(url.removesuffix("/v1") + f"/rft/v1/sessions/{name}/reward", json={"reward": reward},
                   headers={"Authorization": f"Bearer {token}"}).raise_for_status()

    def trainer_step():
        while True:
            try:
                return json.load(open(run_dir + "/progress.json"))["step"]
            except ValueError:  # read while it was being written
                time.sleep(0.05)

    session("a", 1.0)
    session("b", 0.0)
    after_b = trainer_step()
    while trainer_step() < after_b + 3:  # a few training steps (and weight syncs) pass; a fixed sleep
        time.sleep(0.05)                 # outlasted the whole run on a fast machine
    session("c", 1.0)
    session("d", 0.0)
    print("agent done")
""")


def test_an_agents_sessions_are_trained_on_in_a_run_and_later_calls_see_newer_weights(tmp_path):
    import os
    import stat

    from rft.buffer.experience import from_table
    from rft.buffer.shards import ExperienceBuffer
    from tests.e2e.helpers import launch_until_step, stop_launcher

    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 "rollout.openai_api=true", "rollout.tasks_per_step=8", "stages.0.trainer.max_steps=20",
                 "stages.1.trainer.max_steps=40"]
    launcher = launch_until_step(overrides, run_dir, 21)  # in GRPO: every step trains and syncs weights
    try:
        mode = stat.S_IMODE(os.stat(run_dir / "endpoints.json").st_mode)
        assert mode == 0o600, oct(mode)  # the token is the owner's only
        assert json.loads((run_dir / "endpoints.json").read_text())["endpoints"][0]["url"].startswith(
            "http://127.0.0.1:")  # a local run binds to localhost, never to every interface
        agent = subprocess.run([sys.executable, "-c", RUN_AGENT, str(run_dir)], capture_output=True, text=True,
                               timeout=300)
        assert agent.returncode == 0, agent.stderr[-3000:]
        out, err = launcher.communicate(timeout=600)
    finally:
        stop_launcher(launcher)
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    assert "OpenAI-compatible endpoint(s): http://127.0.0.1:" in out and str(run_dir / "endpoints.json") in out
    assert "OpenAI-compatible endpoint at http://127.0.0.1:" in (run_dir / "logs").joinpath(
        next(p for p in os.listdir(run_dir / "logs") if p.endswith("_1_log.out"))).read_text()

    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    rows = {}
    for name in buffer.consumed():  # what the trainer trained on
        import pyarrow.parquet as pq

        table = pq.read_table(run_dir / "buffer" / f"{name}.done")
        for exp in from_table(table):
            if exp.group_id == "session:agent-task":
                rows.setdefault(exp.trajectory_id, []).append(exp)
    assert sorted(rows) == ["a", "b", "c", "d"], sorted(rows)  # every session trained on, once
    version = {name: min(e.version for e in exps) for name, exps in rows.items()}
    assert min(version["c"], version["d"]) > max(version["a"], version["b"]), version  # newer weights later
    assert {name: exps[0].reward for name, exps in rows.items()} == {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0}


def test_a_port_in_use_is_named(engine):
    import socket

    from rft.explorer.openai_endpoint import OpenAIEndpoint

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"could not serve the OpenAI endpoint on 127.0.0.1:{port}"):
            OpenAIEndpoint(engine, "127.0.0.1", port, "token").start()
