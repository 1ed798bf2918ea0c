"""sync.decoupled=true on the local Slurm: the explorer (mode=explore) and the trainer (mode=train)
as two jobs on one run.output_dir, GRPO from the quickstart's SFT warm-up. A third of the way in
the explorer's job is killed (SIGKILL, as a node failure would) in the middle of the second step
after its checkpoint and launched again; two thirds of the way in, the trainer's is cancelled
(scancel). Each resumes from its own checkpoint while the other waits for it, and the run ends as
if never stopped: every step's shard trained exactly once, every trainer step logged once, no
shard trained more than buffer.max_staleness steps after its weights, and the run learns."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from signal import SIGKILL

from tests.e2e.helpers import REPO, stopped_by_fault

sys.path.insert(0, os.path.join(REPO, "tools"))
from chaos import check_run  # noqa: E402

from rft.runtime.storage import read_jsonl  # noqa: E402

STEPS, LEAD, SAVE_EVERY = 18, 1, 2
STAGE = f"stages=[{{name: grpo, algorithm: {{name: grpo, lr: 3.0e-4, clip_eps: 0.2}}, trainer: {{max_steps: {STEPS}}}}}]"
# the explorer's step that its job is killed in: after its checkpoint at 8 and its shard of step 9,
# with step 10 generated (its generation journal full) but neither written nor checkpointed
KILLED_IN = 10


def _launch(run: Path, model: str, mode: str, faults: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=slurm", "cluster.wait=true",
         f"mode={mode}", "sync.decoupled=true", f"buffer.max_staleness={LEAD}", f"trainer.save_interval={SAVE_EVERY}",
         f"run.output_dir={run}", "model.tiny=null", f"model.path={model}", STAGE, "monitor.progress=false",
         "monitor.plots=false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RFT_FAULTS": faults} if faults else None)


def _trained(run: Path) -> int:
    try:
        return json.loads((run / "trainer" / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _kill_stopped_explorer(run: Path) -> bool:
    """Kill the explorer's rank once it has stopped itself in step KILLED_IN; whether it had. Killed
    here, not through Slurm: Slurm's kill sends SIGCONT first (slurmstepd wakes stopped tasks so they
    can die), and the explorer ran on to write its shard and checkpoint before SIGKILL came (seen:
    0.3 s later)."""
    pid = stopped_by_fault(run / "explorer", "stop_generation", KILLED_IN)
    if pid is not None:
        os.kill(pid, SIGKILL)
    return pid is not None


def _cancel_when(ready, job: str, run: Path, launcher: subprocess.Popen, others: list[subprocess.Popen],
                 signal: str | None = None, check: bool = True) -> str:
    """Once `ready()`, scancel `job`'s (explorer or trainer) newest Slurm job, or send its steps
    `signal`; its launcher's output. The deadline only bounds a hang."""
    deadline = time.time() + 600
    while not ready():
        assert time.time() < deadline and all(p.poll() is None for p in (launcher, *others)), \
            [p.communicate()[0][-3000:] for p in (launcher, *others) if p.poll() is not None]
        time.sleep(0.1)
    newest_log = max((run / job / "logs").glob("*_0_log.out"), key=os.path.getmtime)
    subprocess.run(["scancel", *([f"--signal={signal}"] if signal else []), newest_log.name.split("_")[0]], check=check)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode != 0, out[-3000:]
    return out


def test_an_explorer_job_and_a_trainer_job_learn_and_each_is_cancelled_and_relaunched_alone(
        slurm, exported_sft_model, tmp_path):
    run = tmp_path / "run"
    # the explorer stops itself (SIGSTOP) once step 10 is generated, before its shard is written, and
    # its job is killed there: it has steps 9 (shard written, not checkpointed) and 10 (only in its
    # generation journal) to take again, whatever a step takes on this machine. Killing it "at once"
    # after its shard of step 9 raced it: a quick step 10 was written and checkpointed before the kill
    # landed, and the restarted explorer had nothing to take again. Killed (SIGKILL), as a node failure
    # would: a cancel's SIGTERM lets the explorer finish its step within Slurm's KillWait (5 s)
    explorer = _launch(run, exported_sft_model, "explore", faults=f"stop_generation@{KILLED_IN}")
    trainer = _launch(run, exported_sft_model, "train")
    try:
        _cancel_when(lambda: _kill_stopped_explorer(run), "explorer", run, explorer, [trainer], signal="KILL",
                     check=False)  # its job may have ended already, with its rank
        explorer = _launch(run, exported_sft_model, "explore")  # the trainer waits for its shards meanwhile
        _cancel_when(lambda: _trained(run) >= 2 * STEPS // 3, "trainer", run, trainer, [explorer])
        trainer = _launch(run, exported_sft_model, "train")  # the explorer waits for its weights meanwhile
        outs = {name: p.communicate(timeout=600)[0] for name, p in (("explorer", explorer), ("trainer", trainer))}
    finally:
        for p in (explorer, trainer):
            if p.poll() is None:
                p.kill()
    for name, p in (("explorer", explorer), ("trainer", trainer)):
        assert p.returncode == 0, outs[name][-3000:]
    plan = " ".join(outs["trainer"].replace("│", " ").split())
    assert "decoupled this job trains; the explorer job (mode=explore) explores." in plan, plan[:3000]

    # each job resumed from a checkpoint of its own, mid-run
    logs = {job: "".join(p.read_text() for p in (run / job / "logs").glob("*_log.out")) for job in ("explorer", "trainer")}
    assert "resuming from" in logs["explorer"] and "resuming from" in logs["trainer"]
    # the restarted explorer ran again the steps after its checkpoint without writing their shards again,
    # taking back from its generation journal what the cancelled attempt had sampled
    assert "its shard was written before the restart; kept, not written again" in logs["explorer"]
    rollout = list(read_jsonl(run / "explorer" / "metrics" / "rollout0.jsonl"))
    assert sum(r.get("rollout/replayed_samples", 0) for r in rollout) > 0
    # every shard trained exactly once, every trainer step logged once (tools/chaos.py's checks)
    assert check_run(str(run), STEPS, sft_steps=0, producer=0, trainer_dir=str(run / "trainer")) == {
        "experience_lost": 0, "experience_extra": 0, "metric_gaps": 0}
    # no shard older than the bound: shard e (trained at step e + 1) came from weights >= e - LEAD
    manifest = list(read_jsonl(run / "buffer" / "manifest.jsonl"))
    assert {e["step"] for e in manifest} == set(range(STEPS))
    assert all(e["version"] >= e["step"] - LEAD for e in manifest), [(e["step"], e["version"]) for e in manifest]
    assert max(e["version"] for e in manifest) > 0  # the explorer did follow the trainer's weights
    trained = [r for r in read_jsonl(run / "trainer" / "metrics" / "trainer0.jsonl") if "loss/policy" in r]
    assert len(trained) == STEPS and all(r.get("buffer/stale_dropped", 0) == 0 for r in trained)
    # the run learns, with the quickstart test's thresholds
    evals = {e["when"]: e["accuracy"] for e in read_jsonl(run / "explorer" / "metrics" / "eval.jsonl")}
    assert evals["start"] >= 0.15 and evals["end"] >= evals["start"] + 0.05, evals
