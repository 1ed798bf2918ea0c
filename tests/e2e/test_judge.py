"""A judge engine in the quickstart, through the real launcher: a judge rank serves a frozen vLLM
engine (rft/explorer/judge_rank.py), the GRPO stage's reward (`llm_judge`) asks it through the
`openai` client, and a judge that hangs (its vLLM engine process stopped mid-run) costs timeouts
that are counted, not the run."""

import json
import os
import signal
import time

from rft.launch.job_state import process_running as alive
from tests.e2e.helpers import launch_until_step, progress_step, stop_launcher, tensorboard_scalars

SFT, GRPO, TIMEOUT_S = 20, 8, 3


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


def test_a_reward_asks_the_judge_and_a_hung_judge_costs_timeouts_not_the_run(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 f"stages.0.trainer.max_steps={SFT}", f"stages.1.trainer.max_steps={GRPO}",
                 "+stages.1.algorithm.reward=llm_judge", "cluster.judge_ranks=1", f"judge.timeout_s={TIMEOUT_S}",
                 "data.eval_limit=32"]
    launcher = launch_until_step(overrides, run_dir, SFT + 2)  # two GRPO steps judged by a live judge
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
    assert summary["reward_errors"] == judge["timeouts"]  # a timed-out judge call scores 0, counted
    assert "timed out" in out and "judge calls:" in out

    scalars = tensorboard_scalars(str(run_dir))
    timeouts = dict(scalars["judge/timeouts"])
    calls = dict(scalars["judge/calls"])
    assert all(calls[s] > 0 and timeouts[s] == 0 for s in range(SFT + 1, SFT + 2)), (calls, timeouts)
    assert all(timeouts[s] == calls[s] > 0 for s in range(hung_at + 2, SFT + GRPO + 1)), (calls, timeouts)
    assert len(scalars["loss/policy"]) >= SFT + GRPO  # every step trained: the run went on
    # the judge rank ended with the run, and its stopped engine went with it
    deadline = time.time() + 30
    while alive(judge_core) and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(judge_core)
