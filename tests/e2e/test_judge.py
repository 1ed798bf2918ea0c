"""A judge engine in the quickstart, through the real launcher: a judge rank serves a frozen vLLM
engine (rft/explorer/judge_rank.py); a GRPO stage judged relatively (`relative_judge`: a group's
answers in one prompt, rft/explorer/relative_judge.py) asks it first, then one judged per answer
(`llm_judge`), both through the `openai` client; and a judge that hangs (its vLLM engine process
stopped mid-run) costs timeouts that are counted, not the run.

The judge is the tiny model with 2048 positions (the policy's 64 cannot hold a group's prompt): it
writes no JSON, so the relative stage's groups take the neutral score and are counted as parse
failures; the parser's reading of real replies is tested against an HTTP server in
tests/unit/test_relative_judge.py."""

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from rft.launch.job_state import process_running as alive
from tests.e2e.helpers import launch_until_step, progress_step, stop_launcher, tensorboard_scalars

SFT, RELATIVE, JUDGED, TIMEOUT_S = 20, 2, 6, 3
RELATIVE_TASKS = 8  # groups a relative step sends the judge, each one prompt of ~1000 tokens
# tasks an llm_judge step sends (x 8 answers, one judge call each). The live judge must answer each
# step's calls within TIMEOUT_S while the rollout and trainer ranks share the 2 cores: the
# quickstart's 32 tasks (256 calls at once) did not on a loaded CI machine (178 of 256 timed out,
# 2026-11-28); 4 tasks (32 calls) are answered in well under a second here.
JUDGED_TASKS = 4
GRPO = RELATIVE + JUDGED
QUICKSTART = Path(__file__).resolve().parents[2] / "conf" / "experiment" / "quickstart.yaml"


def _hydra(value) -> str:
    """A value in Hydra's override syntax."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    return str(value)


def _stages() -> str:
    """The quickstart's SFT stage, then its GRPO stage twice: judged relatively, then per answer."""
    sft, grpo = yaml.safe_load(QUICKSTART.read_text())["stages"]
    sft["trainer"]["max_steps"] = SFT
    relative = {"name": "relative", "algorithm": {**grpo["algorithm"], "reward": "relative_judge"},
                "rollout": {"tasks_per_step": RELATIVE_TASKS}, "trainer": {**grpo["trainer"], "max_steps": RELATIVE}}
    judged = {**grpo, "algorithm": {**grpo["algorithm"], "reward": "llm_judge"},
              "rollout": {"tasks_per_step": JUDGED_TASKS}, "trainer": {**grpo["trainer"], "max_steps": JUDGED}}
    return "stages=[" + ", ".join(_hydra(stage) for stage in (sft, relative, judged)) + "]"


def _judge_model(tmp_path) -> str:
    from rft.config import TinyModelConfig
    from rft.models.tiny import create_tiny_model

    return create_tiny_model(TinyModelConfig(max_position_embeddings=2048), str(tmp_path / "judge"), seed=1)


def _engine_core_of(rank_pid: int) -> int:
    """The vLLM engine process a rank started (it shares the rank's process group)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                group = int(f.read().rsplit(")", 1)[1].split()[2])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError):
            continue
        if group == rank_pid and int(entry) != rank_pid and b"EngineCore" in cmdline:
            return int(entry)
    raise AssertionError(f"no vLLM engine process in the process group of rank {rank_pid}")


def test_rewards_ask_the_judge_and_a_hung_judge_costs_timeouts_not_the_run(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 _stages(), "cluster.judge_ranks=1", f"judge.timeout_s={TIMEOUT_S}", "data.eval_limit=32",
                 f"judge.model={_judge_model(tmp_path)}", "judge.chat_template=false", "judge.relative_max_new_tokens=16"]
    # the relative stage and two llm_judge steps judged by a live judge
    launcher = launch_until_step(overrides, run_dir, SFT + RELATIVE + 2)
    try:
        judge_core = _engine_core_of(int((run_dir / "pids" / "rank2.pid").read_text()))
        os.kill(judge_core, signal.SIGSTOP)  # the judge hangs: it accepts calls and never answers
        hung_at = progress_step(run_dir)
        out, err = launcher.communicate(timeout=600)
    finally:
        stop_launcher(launcher)
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    plan = " ".join(out.replace("│", " ").split())
    assert "judge ranks [2] (frozen vLLM, TP=1" in plan
    summary = json.loads((run_dir / "summary.json").read_text())
    judge = summary["judge"]
    assert judge["errors"] == 0, judge
    assert judge["timeouts"] > 0 and judge["calls"] > judge["timeouts"], judge  # answered, then hung
    # a timed-out llm_judge call scores 0, a reward error; relative_judge's scores 0.5 (not an error)
    assert 0 < summary["reward_errors"] <= judge["timeouts"]
    assert judge["parse_failures"] > 0  # the relative stage's replies: no JSON from the tiny judge
    assert "timed out" in out and "judge calls:" in out and "unparsed" in out

    scalars = tensorboard_scalars(str(run_dir))
    timeouts = dict(scalars["judge/timeouts"])
    calls = dict(scalars["judge/calls"])
    assert all(calls[s] > 0 and timeouts[s] == 0 for s in range(SFT + 1, SFT + RELATIVE + 2)), (calls, timeouts)
    # relative judging: one call per group (and one per eval task), each reply parsed or counted
    unparsed, reward_errors = dict(scalars["judge/parse_failures"]), dict(scalars["rollout/reward_errors"])
    for s in range(SFT + 1, SFT + RELATIVE + 1):
        assert calls[s] >= RELATIVE_TASKS and 0 < unparsed[s] <= calls[s] and reward_errors[s] == 0, (s, calls, unparsed)
    relative_shards = 0
    for shard in (run_dir / "buffer").glob("step*.parquet.done"):
        rows = pq.read_table(shard, columns=["step", "group_id", "reward"]).to_pylist()
        if SFT <= rows[0]["step"] < SFT + RELATIVE:  # trained at global steps SFT + 1 ..
            relative_shards += 1
            groups: dict[str, list[float]] = {}
            for row in rows:
                groups.setdefault(row["group_id"], []).append(row["reward"])
            assert all(0.0 <= r <= 1.0 for r in sum(groups.values(), [])), groups
            assert any(set(g) == {0.5} for g in groups.values()), groups  # the neutral score of an unparsed reply
    assert relative_shards == RELATIVE
    # llm_judge: every timed-out call scored 0 as a reward error
    llm_steps = range(SFT + RELATIVE + 1, SFT + GRPO + 1)
    assert all(reward_errors[s] == timeouts[s] for s in llm_steps), (reward_errors, timeouts)
    assert all(timeouts[s] == calls[s] > 0 for s in range(hung_at + 2, SFT + GRPO + 1)), (calls, timeouts)
    assert len(scalars["loss/policy"]) >= SFT + GRPO  # every step trained: the run went on
    # the judge rank ended with the run, and its stopped engine went with it
    deadline = time.time() + 30
    while alive(judge_core) and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(judge_core)
