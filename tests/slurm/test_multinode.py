"""Runs that cross a node boundary, on a real two-node Slurm (tools/slurm_local.sh with
RFT_SLURM_NODES=2: a network namespace, address and hostname per node): the trainer on one node
and the rollout rank on the other, that rollout node cut off and then crashed mid-run and the run
resumed each time, a lost rollout node the run goes on without (rollout.on_engine_failure=continue),
a TP=2 trainer split over both nodes, a sweep's runs on different nodes, and a rendezvous that
cannot work failing in seconds with a message that names what to change."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, stop_launcher, stopped_by_fault

sys.path.insert(0, os.path.join(REPO, "tools"))
from chaos import check_run  # noqa: E402

from rft.runtime.checkpoint import newest_complete  # noqa: E402

SCRIPT = os.path.join(REPO, "tools", "slurm_local.sh")
GRPO = "stages=[{name: grpo, algorithm: {name: grpo}, trainer: {max_steps: 2}}]"
STEPS, TIMEOUT_S, SAVE_EVERY = 8, 30, 2
CUT_AT = 4  # node2's link goes down as its rollout rank is about to generate this step (3 trained)
LONG = "stages=[{name: grpo, algorithm: {name: grpo}, trainer: {max_steps: %d}}]" % STEPS
COMMON = ("+experiment=quickstart", "cluster=slurm", "cluster.wait=true", "cluster.nodes=2", "monitor.progress=false",
          "monitor.plots=false", "data.eval_limit=8")  # no figures: 4 s of the launcher's CPU each, never checked


def _launch(env: dict, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rft.launch", *COMMON, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rank_lines(run_dir, job_id: str, ranks: int) -> list[str]:
    """Each rank's first line: its role, node, address and where it met rank 0."""
    lines = []
    for rank in range(ranks):
        log = (run_dir / "logs" / f"{job_id}_{rank}_log.out").read_text()
        lines.append(next(line for line in log.splitlines() if line.startswith(f"rank {rank}/")))
    return lines


def _steps_on(env: dict, job_id: str) -> list[str]:
    """sacct's JobID|NodeList|NTasks of the job's steps (slurmdbd records them just after the job;
    the deadline only bounds a hang)."""
    deadline = time.monotonic() + 120
    while True:
        rows = subprocess.run(["sacct", "-j", job_id, "-n", "-P", "-o", "JobID,NodeList,NTasks,State"],
                              env=env, capture_output=True, text=True, check=True).stdout.split()
        steps = [row for row in rows if row.startswith(f"{job_id}.0|")]
        if steps and steps[0].endswith("|COMPLETED"):
            return steps
        if time.monotonic() > deadline:
            return rows
        time.sleep(1)


def _node_back(env: dict) -> None:
    """`start` again brings a lost node's slurmd back and a cut link up; Slurm then clears the
    failed job from the node once that slurmd answers."""
    subprocess.run(["bash", SCRIPT, "start"], env=env, check=True, capture_output=True)
    for _ in range(120):
        if not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
            return
        time.sleep(1)


def _trained_steps(run_dir: str) -> int:
    """The training steps the trainer has logged, over every launch into `run_dir`."""
    metrics = Path(run_dir, "metrics", "trainer0.jsonl")
    return metrics.read_text().count('"loss/policy"') if metrics.exists() else 0


def _fail_node2_when(env: dict, args: tuple, how: str, ready, faults: str = "") -> dict:
    """Launch (with RFT_FAULTS=`faults`); once `ready()` says the moment has come (the pids of
    ranks it stopped for the fault, to go on after it), `tools/slurm_local.sh <how> 2` and SIGCONT
    those; wait for the launcher to end. Its output, exit code, seconds from the fault to its end and
    to the line naming the failed rank, and the newest complete checkpoint (where launching again resumes:
    the launcher returns once the other ranks saved on its cancel's SIGTERM, or Slurm killed them)."""
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.output_dir="))
    launcher = subprocess.Popen([sys.executable, "-m", "rft.launch", *COMMON, *args], cwd=REPO,
                                env={**env, "RFT_FAULTS": faults} if faults else env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []  # (when read, line): the pipe is read as the launcher writes
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in launcher.stdout),
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + 900  # only bounds a hang
    while (stopped := ready()) is None:
        if launcher.poll() is not None or time.monotonic() > deadline:
            stop_launcher(launcher)
            reader.join(timeout=60)
            raise AssertionError(f"the fault's moment never came: {''.join(line for _, line in lines)[-3000:]}")
        time.sleep(0.2)
    at = time.monotonic()
    subprocess.run(["bash", SCRIPT, how, "2"], env=env, check=True)
    for pid in stopped:
        os.kill(pid, signal.SIGCONT)
    launcher.wait(timeout=600)
    after = time.monotonic() - at
    reader.join(timeout=60)
    named = next((when - at for when, line in lines if re.match(r"rank \d+ failed: ", line)), None)
    newest = newest_complete(run_dir, [0, 1])
    return {"out": " ".join("".join(line for _, line in lines).split()), "rc": launcher.returncode, "after": after,
            "named": named, "saved": newest.done if newest else 0}


@pytest.fixture(scope="module")
def partitioned_crashed_and_resumed(two_nodes, tmp_path_factory) -> dict:
    """The quickstart's GRPO across two nodes (trainer on node1, rollout on node2, a checkpoint
    every 2 steps, sync.timeout_s=30). After 3 steps node2's link goes down (a partition: its
    processes live on); the link comes back and the same command resumes from the newest complete
    checkpoint. Once that launch has trained to its next checkpoint, node2 crashes (every process
    on it killed at once); it comes back and the same command resumes the run to its end.

    Each fault lands as node2's rollout rank is about to generate a step: RFT_FAULTS stops it there
    (SIGSTOP) until the fault is made, and the partitioned one then goes on. So each launch is at
    the same point when its fault lands, on a fast or a loaded machine: watching the trainer's steps
    and faulting "at once" let the run go a step or two further, and the crash could then come too
    late in the run. Which checkpoint each launch left is read from the run, not assumed."""
    run_dir = tmp_path_factory.mktemp("lost") / "run"
    args = (f"run.output_dir={run_dir}", LONG, f"trainer.save_interval={SAVE_EVERY}", f"sync.timeout_s={TIMEOUT_S}")

    def cut_off() -> list[int] | None:  # rank 1 stopped before its step CUT_AT: it goes on once cut off
        pid = stopped_by_fault(run_dir, "stop_generating", CUT_AT, 1)
        return None if pid is None else [pid]

    cut = _fail_node2_when(two_nodes, args, "cut-node", cut_off, faults=f"stop_generating@{CUT_AT}#1")
    _node_back(two_nodes)
    # the resumed launch trains from the cut's checkpoint to the next one; node2 crashes as its rollout
    # rank is about to generate the step after that
    crash_at = (cut["saved"] // SAVE_EVERY + 1) * SAVE_EVERY + 1
    assert crash_at <= STEPS, cut
    crashed = _fail_node2_when(two_nodes, args, "lose-node",
                               lambda: [] if stopped_by_fault(run_dir, "stop_generating", crash_at, 1) else None,
                               faults=f"stop_generating@{crash_at}#1")
    _node_back(two_nodes)
    return {"run_dir": run_dir, "cut": cut, "crashed": crashed, "resumed": _launch(two_nodes, *args)}


def test_trainer_and_rollout_on_two_nodes_meet_at_the_first_nodes_address(partitioned_crashed_and_resumed, two_nodes):
    run_dir, result = partitioned_crashed_and_resumed["run_dir"], partitioned_crashed_and_resumed["resumed"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = " ".join(result.stdout.replace("│", " ").split())
    assert "node 0: rank 0 (trainer) node 1: rank 1 (rollout)" in plan
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    trainer, rollout = _rank_lines(run_dir, job_id, 2)
    assert trainer.endswith("on node1 (10.213.0.11), rank 0 at 10.213.0.11:" + trainer.rsplit(":", 1)[1])
    assert "on node2 (10.213.0.12), rank 0 at 10.213.0.11:" in rollout  # never 127.0.0.1
    # the weights crossed the node boundary at every sync; the experience came through the shared filesystem
    assert json.loads((run_dir / "metrics" / "summary-rank1.json").read_text())["version"] == STEPS
    assert _steps_on(two_nodes, job_id) == [f"{job_id}.0|node[1-2]|2|COMPLETED"]


def test_a_partitioned_node_is_named_within_the_bound(partitioned_crashed_and_resumed):
    """node2's link down: its rank lives on, but rank 0's store stops answering it. Its pulse
    records that, and the launcher names it, its node and its last log lines once that has lasted
    sync.timeout_s. The bound: sync.timeout_s + 2 x PULSE_S (the pulse's period and its connect
    timeout), the product's own waits, + 15 s for the step node2 generates after the cut, the
    launcher's polling and the cancel: 55 s with sync.timeout_s=30, where 30 s were measured
    (docs/guides/nodes.md, 2 cores), so 1.8 x the measured figure."""
    from rft.runtime.pulse import PULSE_S

    cut = partitioned_crashed_and_resumed["cut"]
    assert cut["rc"] == 1, cut["out"][-3000:]
    assert "rank 1 failed: rollout rank 1 lost the network to rank 0: its control store at 10.213.0.11:" in cut["out"]
    assert "(a network partition: a link, switch or interface down between its node and rank 0's)" in cut["out"]
    assert "on node node2 (10.213.0.12), which ran rank(s) 1 the job's nodes: node1 (10.213.0.11): rank(s) 0; " \
           "node2 (10.213.0.12): rank(s) 1 last lines of its log.out:" in cut["out"]
    assert cut["named"] is not None and cut["named"] < TIMEOUT_S + 2 * PULSE_S + 15, cut["named"]


def test_a_crashed_node_is_named_within_the_bound_and_the_run_resumes_losing_nothing(partitioned_crashed_and_resumed):
    """node2 crashes while the trainer waits for its next step's experience; once the rollout rank's
    pulse has been silent for sync.timeout_s + 2 x SILENT_S (the launcher's hang bound,
    rft/launch/submit.py: its peers had their chance to time out), the launcher names the rank,
    its node, what else ran there and its last log lines. The bound: that wait, the product's own,
    + 15 s for the launcher's polling, report and cancel. Measured (docs/guides/nodes.md, 2 cores):
    97 s with sync.timeout_s=60, 3 s under the wait, as the pulse is up to PULSE_S (5 s) old when
    the node dies: the launcher's own part took under 5 s, and the 15 s margin is 3 x that. After
    the partition and the crash, the run resumed twice, each time from the checkpoint the faulted
    launch had left, and lost nothing."""
    from rft.runtime.pulse import SILENT_S

    crashed = partitioned_crashed_and_resumed["crashed"]
    assert crashed["rc"] == 1, crashed["out"][-3000:]
    assert "rank 1 failed: rollout rank 1 stopped responding" in crashed["out"], crashed["out"][-3000:]
    assert "on node node2 (10.213.0.12), which ran rank(s) 1 the job's nodes: node1 (10.213.0.11): rank(s) 0; " \
           "node2 (10.213.0.12): rank(s) 1 last lines of its log.out:" in crashed["out"]
    assert crashed["named"] is not None and crashed["named"] < TIMEOUT_S + 2 * SILENT_S + 15, crashed["named"]
    run_dir = partitioned_crashed_and_resumed["run_dir"]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_0_log.out"))
    resumed_at = [int(done) for done in re.findall(r"^resuming from .* \((\d+) steps done\)$", logs, re.MULTILINE)]
    cut = partitioned_crashed_and_resumed["cut"]
    assert resumed_at == [cut["saved"], crashed["saved"]], resumed_at  # after the partition, after the crash
    # each resumed mid-run: the cut came after the checkpoint at 2, the crash after the resumed launch's next one
    assert 2 <= cut["saved"] < crashed["saved"] < STEPS, (cut["saved"], crashed["saved"])
    # every step's experience trained exactly once, every step logged once (tools/chaos.py's checks)
    assert check_run(str(run_dir), STEPS, sft_steps=0, producer=1) == {
        "experience_lost": 0, "experience_extra": 0, "metric_gaps": 0}


def test_a_tp2_trainer_splits_over_two_nodes(two_nodes, tmp_path):
    """SFT (trainer ranks only): the two tensor-parallel halves of the model on different nodes."""
    run_dir = tmp_path / "run"
    result = _launch(two_nodes, f"run.output_dir={run_dir}", "mode=train", "stages=[]", "algorithm=sft",
                     "trainer.max_steps=2", "cluster.trainer_ranks=2", "trainer.tensor_parallel_size=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    first, second = _rank_lines(run_dir, job_id, 2)
    assert "on node1 (10.213.0.11)" in first and "on node2 (10.213.0.12), rank 0 at 10.213.0.11:" in second
    trained = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    assert len([row for row in trained if "loss/policy" in row]) == 2


def test_a_rendezvous_at_a_loopback_address_fails_in_seconds_naming_the_setting(two_nodes, tmp_path):
    """`localhost` is each node's own loopback: the rank on the second node says so at once (it
    would otherwise retry for the whole sync timeout), and the launcher reports it."""
    started = time.monotonic()
    result = _launch(two_nodes, f"run.output_dir={tmp_path / 'run'}", GRPO, "cluster.rendezvous_addr=localhost",
                     timeout=300)
    took = time.monotonic() - started
    assert result.returncode != 0
    said = " ".join((result.stdout + result.stderr).split())
    assert "rank 1" in said and "cluster.rendezvous_addr: 'localhost' is 127.0.0.1 on node node2" in said, said[-3000:]
    # submit, start, fail and report, no sync timeout (600 s) waited out: about 25 s measured
    # (docs/guides/nodes.md, 2 cores), the bound about 5 x that and still far under the 600 s
    assert took < 120, took


def test_a_sweep_is_one_job_array_whose_runs_land_on_different_nodes(two_nodes, tmp_path):
    """`-m seed=1,2`: one job array, one task per run, each run in its own output dir. Each run
    takes a whole node (2 tasks x 2 CPUs of its 4), so Slurm places the array's two tasks on the
    two nodes, where they run at the same time, each meeting at its own node; sacct shows both
    completed, as a user would check. Their MLflow server does not answer (nothing listens at the
    address): one warning line per run on the terminal and per rank in its log, and the runs go on.
    `python -m rft.plot` on the sweep directory draws both runs in one figure."""
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=slurm", "cluster.wait=true",
         "cluster.cpus_per_task=2", "seed=1,2", f"hydra.sweep.dir={sweep_dir}", "monitor.progress=false",
         "data.eval_limit=8", GRPO, "monitor.loggers=[tensorboard,mlflow]",
         "monitor.mlflow.tracking_uri=http://127.0.0.1:9"],
        cwd=REPO, env=two_nodes, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = (result.stdout + result.stderr).replace("\n", " ")
    assert said.count("rft: warning: monitor.mlflow.tracking_uri=http://127.0.0.1:9 does not answer") == 2, said[-3000:]
    for rank_log in sorted((sweep_dir / "logs").glob("*_log.err")):
        assert rank_log.read_text().count("rft: warning: monitor.loggers: mlflow could not start") == 1, rank_log
    plotted = subprocess.run([sys.executable, "-m", "rft.plot", str(sweep_dir)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert plotted.returncode == 0 and plotted.stdout.split()[0] == str(sweep_dir / "plots" / "compare.png")
    legend = (sweep_dir / "plots" / "compare.svg").read_text()
    assert "seed=1" in legend and "seed=2" in legend
    array_id = result.stdout.split("submitted array job ")[1].split()[0]
    assert "(2 runs x 2 tasks)" in result.stdout
    nodes = set()
    for index, seed in enumerate((1, 2)):
        assert f"seed: {seed}\n" in (sweep_dir / str(index) / "config.yaml").read_text()
        log = (sweep_dir / "logs" / f"{array_id}_{index}_0_log.out").read_text()
        line = next(line for line in log.splitlines() if line.startswith("rank 0/2"))
        node = line.split(" on ")[1].split()[0]
        assert f"on {node} (10.213.0.1{node[-1]}), rank 0 at 10.213.0.1{node[-1]}:" in line  # its own node
        nodes.add(node)
        assert json.loads((sweep_dir / str(index) / "metrics" / "summary-rank1.json").read_text())["version"] == 2
    assert nodes == {"node1", "node2"}
    deadline = time.monotonic() + 120  # only bounds a hang
    while True:  # the launcher returned once Slurm no longer lists the jobs; slurmdbd records them just after
        states = subprocess.run(["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State"], env=two_nodes,
                                capture_output=True, text=True, check=True).stdout.split()
        if all("|COMPLETED" in state for state in states) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sorted(states) == [f"{array_id}_0|COMPLETED", f"{array_id}_1|COMPLETED"], states


# the launcher inside an allocation: cluster=auto, as a user types it there
IN_ALLOCATION = ("+experiment=quickstart", "monitor.progress=false", "monitor.plots=false", "data.eval_limit=8", GRPO)


def _jobs_since(env: dict, since: float, job_id: str) -> list[str]:
    """Every job that ran from `since` (epoch seconds) on, once sacct lists `job_id` (slurmdbd records
    a job just after it; the deadline only bounds a hang). By time, not id: the accounting database
    outlives the instance's job ids. sacct -X: the jobs, not their steps."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 1))
    deadline = time.monotonic() + 120
    while True:
        jobs = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", start], env=env, capture_output=True,
                              text=True, check=True).stdout.split()
        if job_id in jobs or time.monotonic() > deadline:
            return jobs
        time.sleep(1)


def test_the_launcher_in_a_batch_script_runs_the_ranks_as_a_step_of_its_two_node_job(two_nodes, tmp_path):
    """A user's sbatch script of two nodes that calls the launcher (cluster=auto): the trainer on
    node1 and the rollout rank on node2 run as a step of that job, met at node1's address, and no
    second job is queued; the script ends with the run's status."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    launch = shlex.join([sys.executable, "-m", "rft.launch", *IN_ALLOCATION, "cluster.nodes=2", f"run.output_dir={run_dir}"])
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {shlex.quote(REPO)}\n{launch}\n")
    since = time.time()
    job = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                          f"--output={out}", str(script)], env=two_nodes, capture_output=True, text=True, timeout=900)
    said = out.read_text()
    assert job.returncode == 0, said[-3000:] + job.stderr
    job_id = job.stdout.strip()
    assert (f"rft: cluster=auto -> slurm (inside Slurm job {job_id} (2 node(s)): the ranks run as a step of its "
            "allocation (srun), not as a new job)") in said, said[:3000]
    assert f"started the ranks as a step of job {job_id} (2 tasks)" in said
    plan = " ".join(said.replace("│", " ").split())
    assert f"the ranks run as a step (srun) of job {job_id}, on 2 of its nodes; no new job is queued" in plan
    trainer, rollout = _rank_lines(run_dir, job_id, 2)
    assert trainer.endswith("on node1 (10.213.0.11), rank 0 at 10.213.0.11:" + trainer.rsplit(":", 1)[1])
    assert "on node2 (10.213.0.12), rank 0 at 10.213.0.11:" in rollout
    assert json.loads((run_dir / "metrics" / "summary-rank1.json").read_text())["version"] == 2
    assert _steps_on(two_nodes, job_id) == [f"{job_id}.0|node[1-2]|2|COMPLETED"]
    assert _jobs_since(two_nodes, since, job_id) == [job_id]  # the batch job alone: no second job was queued


def test_the_launcher_in_sallocs_shell_runs_a_step_and_refuses_more_nodes_than_allocated(two_nodes, tmp_path):
    """`salloc -N1 <launcher>`: salloc runs the launcher here, on none of the job's nodes; the ranks
    run as a step on the allocated node. Asking for more nodes than the allocation holds is refused
    before anything starts, naming cluster.nodes."""
    run_dir = tmp_path / "run"
    launch = [sys.executable, "-m", "rft.launch", *IN_ALLOCATION, f"run.output_dir={run_dir}"]
    salloc = ["salloc", "--nodes=1", "--ntasks=2", "--cpus-per-task=1"]
    refused = subprocess.run([*salloc, *launch, "cluster.nodes=2"], cwd=REPO, env=two_nodes, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    said = " ".join(refused.stderr.split())
    assert "rft: config error: cluster.nodes=2 is invalid: Slurm job" in said, said
    assert "whose allocation the ranks run in, has 1 node(s); lower cluster.nodes" in said, said
    since = time.time()
    result = subprocess.run([*salloc, *launch], cwd=REPO, env=two_nodes, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.split("started the ranks as a step of job ")[1].split()[0]
    assert "the ranks run as a step of its allocation (srun), not as a new job" in result.stdout
    trainer, rollout = _rank_lines(run_dir, job_id, 2)
    node = trainer.split(" on ")[1].split()[0]
    assert f"{node} (10.213.0.1{node[-1]}), rank 0 at 10.213.0.1{node[-1]}:" in rollout  # one node, met at its address
    assert json.loads((run_dir / "metrics" / "summary-rank1.json").read_text())["version"] == 2
    refused_job = re.search(r"Granted job allocation (\d+)", refused.stderr).group(1)
    # salloc's job alone (the refused launch's allocation may end within the second `since` names)
    assert set(_jobs_since(two_nodes, since, job_id)) - {refused_job} == {job_id}


def test_with_continue_a_lost_rollout_node_leaves_the_run_on_the_other_nodes_engine(two_nodes, tmp_path):
    """rollout.on_engine_failure=continue, one trainer and three engines over two nodes: node1
    runs the trainer and engine 0, node2 engines 1 and 2. node2 crashes after 2 of 6 steps. No
    supervisor is left there to say so: rank 0 marks both engines lost once their pulses stop,
    the run finishes on engine 0, every step's tasks are generated (the lost engines' by engine 0)
    and trained exactly once, and the launcher ends without waiting for Slurm to declare node2 down."""
    from rft.buffer.shards import ExperienceBuffer
    from rft.runtime.pulse import SILENT_S

    run_dir, steps = tmp_path / "run", 6
    # the node is lost by its heartbeats (SILENT_S), not by a timeout; a longer sync.timeout_s lets the three
    # engines start far apart: under CI's load engine 2's vLLM start came over 30 s after engine 0 had
    # evaluated its share, whose meeting with it then timed out before any fault
    args = (f"run.output_dir={run_dir}", LONG.replace(f"max_steps: {STEPS}", f"max_steps: {steps}"),
            f"sync.timeout_s={4 * TIMEOUT_S}", "cluster.rollout_ranks=3", "rollout.on_engine_failure=continue")
    try:
        # after 2 steps; the checks below need the crash before engines 1 and 2 write shards of the last
        # step, 3 steps later at the earliest, where the poll (0.2 s) and lose-node (a kill) take a fraction
        # of one. Not stopped at a step as the crash above: engines pull their tasks, so whether engines 1
        # and 2 send a request in a given step is not fixed
        lost = _fail_node2_when(two_nodes, args, "lose-node", lambda: [] if _trained_steps(run_dir) >= 2 else None)
    finally:
        _node_back(two_nodes)
    out = lost["out"]
    assert lost["rc"] == 0, out[-3000:]
    for rank, engine in ((2, 1), (3, 2)):
        assert f"engine {engine} lost: rank {rank} failed: rollout rank {rank} (engine {engine}) stopped responding" in out
        assert f"engine lost: rollout rank {rank} (engine {engine}) stopped responding; the run finished on 1 engine(s)" \
            in out
    trainer_log = "".join(p.read_text() for p in (run_dir / "logs").glob("*_0_log.out"))
    assert "rft: rollout rank 3 (engine 2) stopped responding: no heartbeat for" in trainer_log
    # noticed in SILENT_S, then the run's last steps and its end: 28 s measured by hand with 5 steps left
    # (docs/guides/nodes.md, 2 cores); the bound, 120 s, is 4 x that
    assert lost["after"] < 3 * SILENT_S + 60, lost["after"]

    shards: dict[int, dict[int, int]] = {}  # step -> producer -> rows
    for line in (run_dir / "buffer" / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        shards.setdefault(entry["step"], {})[entry["producer"]] = entry["rows"]
    assert sorted(shards) == list(range(steps))  # every step has experience
    rows = {sum(by_producer.values()) for by_producer in shards.values()}
    assert len(rows) == 1, shards  # no task lost: the lost engines' tasks were generated by engine 0
    assert sorted(shards[steps - 1]) == [1], shards  # engine 0 alone at the end
    assert sorted(shards[0]) == [1, 2, 3], shards
    consumed = ExperienceBuffer(str(run_dir / "buffer")).consumed()
    assert len(consumed) == len(set(consumed)) == sum(len(p) for p in shards.values())  # each shard trained once
    assert check_run(str(run_dir), steps, sft_steps=0, producer=1)["metric_gaps"] == 0


def test_a_run_dir_the_nodes_do_not_share_is_named(two_nodes, tmp_path):
    """run.output_dir on a node-local path (each node's own tmpfs at $RFT_SLURM_DIR/local, as /tmp
    on a cluster): the job cannot even write its logs there, and the launcher says why and what
    to use instead, as soon as Slurm has ended the job."""
    run_dir = os.path.join(two_nodes["RFT_SLURM_DIR"], "local", "run")
    started = time.monotonic()
    result = _launch(two_nodes, f"run.output_dir={run_dir}", GRPO, timeout=300)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, said[-3000:]
    assert f"it wrote no log into {run_dir}/logs: the job's nodes may not see run.output_dir ({run_dir}). Put it on " \
           "a filesystem this login node and every compute node share" in said, said[-3000:]
    # "as soon as Slurm has ended the job": 23 s measured (docs/guides/nodes.md, 2 cores), the bound ~4 x that
    assert time.monotonic() - started < 90
