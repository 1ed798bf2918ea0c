"""A chaos run: the quickstart under faults, launched again after each as a user would, to the end.

    python tools/chaos.py [--faults 20] [--seed 0] [--kinds kill_train,stop_sync,...] [--slurm]
                          [--out DIR] [--no-reference] [--free-run] [--experiment quickstart_vl]

The run: the quickstart shortened (30 SFT steps, then 2 GRPO steps per fault + 4), on two trainer
ranks (TP 2) and one rollout rank, a checkpoint every 2 steps, `sync.timeout_s=30` (a hang becomes
an error within that). Each launch carries the next fault of the schedule; faults that end a
launch are acted out inside the run by rft/runtime/faults.py (a rank SIGKILLed or SIGSTOPped during
generation, a train step, a weight sync or a checkpoint save; a checkpoint that finds no room)
or from outside by this script (every process of the job SIGKILLed: a node failure; SIGUSR2 to
every rank: the time limit; SIGTERM: a preemption or `scancel`, which on Slurm is a real `scancel`,
its SIGKILL following after KillWait). A torn shard (`corrupt_shard`) is repaired inside the run, and
a vLLM engine core SIGKILLed or stopped (`kill_engine`, `stop_engine`) is restarted inside it
(rollout.on_engine_failure=restart), so that launch goes on to the next fault. Fault steps come in increasing order, each one past the
checkpoint the launch resumes from, so every launch makes progress.

At the end it checks the run as the tests do: every GRPO step's experience consumed exactly once
(`experience_lost` counts steps whose shard was not), every step logged once by the trainer
(`metric_gaps`), and, unless --no-reference, the final weights, optimizer, RNG and every step's
metrics bit for bit against an uninterrupted run of the same config. It prints a table per launch
and per fault kind; the last line is one JSON object.

--free-run runs the GRPO stage free-running (sync.free_run=true, buffer.max_staleness=2): which
weights a shard was generated with then depends on timing, so there is no bit-for-bit reference;
the exactly-once checks stay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SFT_STEPS, SAVE_EVERY, TIMEOUT_S = 30, 2, 30
ENGINE_STALL_S = 10  # a stopped engine core is killed and restarted after this long without an answer
TRAINERS, ROLLOUT = (0, 1), 2  # global ranks: two TP trainer ranks, then the rollout rank
# fault kind -> the ranks it may hit (None: not one rank); all but corrupt_shard end the launch
KINDS: dict[str, tuple[int, ...] | None] = {
    "kill_generation": (ROLLOUT,), "kill_train": TRAINERS, "kill_sync": TRAINERS, "kill_save": (*TRAINERS, ROLLOUT),
    "stop_generation": (ROLLOUT,), "stop_train": TRAINERS, "stop_sync": TRAINERS,
    "file_size_limit": None, "corrupt_shard": None, "job_kill": None, "usr2": None, "term": None,
    "kill_engine": (ROLLOUT,), "stop_engine": (ROLLOUT,)}
OUTSIDE = ("job_kill", "usr2", "term")  # acted out by this script
UNRECORDED = ("file_size_limit", "corrupt_shard")  # act without a line in <run>/faults.jsonl
SAVE_STEP_KINDS = ("kill_save", "file_size_limit")  # fire only where a checkpoint is saved


FREE_RUN = ("sync.free_run=true", "buffer.max_staleness=2")
# a free-running explorer saves up to max_staleness + 1 steps past the trainer's checkpoint and resumes
# there: a generation fault must come after that, or the resumed launch never reaches it
FREE_RUN_SPACING = SAVE_EVERY + 2


def overrides(run_dir: str, grpo_steps: int, cluster: str, extra: tuple[str, ...] = (),
              restarts: bool = False, experiment: str = "quickstart") -> list[str]:
    return [*extra, f"+experiment={experiment}", f"cluster={cluster}", f"run.output_dir={run_dir}", "monitor.progress=false",
            f"trainer.save_interval={SAVE_EVERY}", f"stages.0.trainer.max_steps={SFT_STEPS}",
            f"stages.1.trainer.max_steps={grpo_steps}", "cluster.trainer_ranks=2", "trainer.tensor_parallel_size=2",
            f"sync.timeout_s={TIMEOUT_S}",
            # the SFT stage only brings the model to where GRPO groups have a reward spread (so that
            # GRPO steps train): 64 rows a step, as the quickstart's warm-up had before its recipe
            # went to 256 for learning carries, and one checkpoint at its end, not every SAVE_EVERY
            "stages.0.trainer.sft_batch_size=64", f"++stages.0.trainer.save_interval={SFT_STEPS}",
            "monitor.plots=false",
            # checkpoints written in the background: each fault also lands while one is being written
            "trainer.async_save=true"] + ([
            # with kill_engine or stop_engine scheduled: the engine core is restarted in the launch
            "rollout.on_engine_failure=restart", f"rollout.engine_stall_s={ENGINE_STALL_S}"] if restarts else []) + (
            ["cluster.wait=true"] if cluster == "slurm" else [])


def schedule(count: int, kinds: list[str], seed: int, spacing: int = SAVE_EVERY) -> list[tuple[str, int, int | None]]:
    """(kind, step, rank) of each fault: kinds cycle through a shuffled list (each kind once
    before any twice), at every `spacing`-th GRPO step from the third on."""
    rng = random.Random(seed)
    order: list[str] = []
    faults = []
    for index in range(count):
        if not order:
            order = rng.sample(kinds, len(kinds))
        kind = order.pop()
        step = SFT_STEPS + 2 + spacing * index  # a checkpoint step: every kind fires there
        ranks = KINDS[kind]
        faults.append((kind, step, rng.choice(ranks) if ranks else None))
    return faults


def repaired_inside(kind: str, cluster: str) -> bool:
    """Faults the run recovers from within the launch: a torn shard is sent again; a vLLM engine
    core killed or stopped is restarted (rollout.on_engine_failure=restart); on Slurm, the
    time-limit signal requeues the job, which resumes by itself."""
    return kind in ("corrupt_shard", "kill_engine", "stop_engine") or (kind == "usr2" and cluster == "slurm")


def progress_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "progress.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return 0


def rank_pids(run_dir: str) -> list[int]:
    pid_dir = os.path.join(run_dir, "pids")
    pids = []
    for name in os.listdir(pid_dir) if os.path.isdir(pid_dir) else []:
        try:
            with open(os.path.join(pid_dir, name)) as f:
                pids.append(int(f.read()))
        except (OSError, ValueError):
            continue
    return pids


def job_id(log: str) -> str | None:
    """The job a launch submitted, from its output ("submitted job <id>")."""
    with open(log) as f:
        match = re.search(r"submitted job (\S+)", f.read())
    return match.group(1) if match else None


def act_from_outside(kind: str, launcher: subprocess.Popen, run_dir: str, log: str, cluster: str) -> None:
    job = job_id(log)
    if cluster == "slurm":  # as Slurm does: the time-limit signal to every task, a cancel, or a node failure
        how = {"usr2": ["-s", "USR2", "-f"], "term": [], "job_kill": ["-s", "KILL", "-f"]}[kind]
        subprocess.run(["scancel", *how, job], check=False)
        return
    if kind in ("usr2", "term"):  # what Slurm sends every task before the time limit, or to cancel it
        for pid in rank_pids(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2 if kind == "usr2" else signal.SIGTERM)
        return
    with contextlib.suppress(ProcessLookupError):  # a node failure: launcher, controller, ranks, engines at once
        os.killpg(launcher.pid, signal.SIGKILL)
    for pid in rank_pids(run_dir):  # each rank leads a process group with its vLLM engine in it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def resumed_from(run_dir: str, log: str) -> int:
    """The checkpoint step the launch's trainer rank resumed from (0: started fresh)."""
    job = job_id(log)
    path = os.path.join(run_dir, "logs", f"{job}_0_log.out")
    if job is None or not os.path.exists(path):
        return 0
    with open(path) as f:
        match = re.search(r"resuming from \S+/checkpoints/step(\d+)", f.read())
    return int(match.group(1)) if match else 0


def stop_launch(launcher: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End a launch in its own session (start_new_session, so a fault can kill it whole): SIGTERM
    lets the launcher cancel its job and stop its ranks; SIGKILL what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGTERM)
    try:
        launcher.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def launch(args: list[str], env: dict[str, str], log: str, outside: list[tuple[str, int]], run_dir: str,
           cluster: str) -> dict:
    """One launch to its end, acting out the `outside` faults (kind, step) in turn; what it did:
    rc, seconds, the launcher's failure line, resumed-from step."""
    start = time.time()
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "rft.launch", *args], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True)
        acted_at, acted_step, todo = None, None, list(outside)
        try:
            while launcher.poll() is None:
                if todo and (acted_step := progress_step(run_dir)) >= todo[0][1]:
                    act_from_outside(todo.pop(0)[0], launcher, run_dir, log, cluster)
                    acted_at = time.time()
                if time.time() - start > 900:
                    raise RuntimeError(f"a launch ran past 900 s; see {log}")
                time.sleep(0.2)
        finally:
            if launcher.poll() is None:  # this tool is ending (an error, Ctrl-C): so does the launch
                stop_launch(launcher)
    ended = time.time()
    with open(log) as f:
        text = f.read()
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if " failed: " in line or " stopped: " in line), None)
    # the launcher's line about the failed rank, and the one after it naming the rank's log
    failure = "" if at is None else " ".join(line.strip() for line in lines[at: at + 2])
    return {"rc": launcher.returncode, "seconds": ended - start, "ended": ended, "acted_at": acted_at,
            "acted_step": acted_step if acted_at else None,
            "failure": failure, "resumed_from": resumed_from(run_dir, log), "reached": progress_step(run_dir)}


def fault_times(run_dir: str) -> dict[tuple[str, int], float]:
    """When each in-run fault struck (rft/runtime/faults.py's record), by (kind, step)."""
    path = os.path.join(run_dir, "faults.jsonl")
    times = {}
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        row = json.loads(line)
        times[(row["fault"], row["step"])] = row["time"]
    return times


def check_run(run_dir: str, grpo_steps: int, sft_steps: int = SFT_STEPS, producer: int = ROLLOUT,
              trainer_dir: str | None = None) -> dict[str, int]:
    """Experience lost (steps whose shard, written by rank `producer`, was not consumed exactly
    once), shards consumed that no step wrote, and trainer steps not logged exactly once.
    `trainer_dir`: where the trainer's metrics are, if not in `run_dir` (a decoupled run's trainer job)."""
    from rft.buffer.shards import ExperienceBuffer
    from rft.runtime.storage import read_jsonl

    buffer = ExperienceBuffer(os.path.join(run_dir, "buffer"))
    expected = {f"step{s:08d}-p{producer:03d}.parquet" for s in range(sft_steps, sft_steps + grpo_steps)}
    consumed = Counter(buffer.consumed())
    logged = Counter(r["step"] for r in read_jsonl(os.path.join(trainer_dir or run_dir, "metrics", "trainer0.jsonl")))
    total = sft_steps + grpo_steps
    return {"experience_lost": sum(1 for name in expected if consumed[name] != 1),
            "experience_extra": sum(1 for name in consumed if name not in expected),
            "metric_gaps": sum(1 for s in range(1, total + 1) if logged[s] != 1)}


def main() -> None:  # noqa: C901  (one run of the tool, top to bottom)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=None, help=f"comma-separated, among {list(KINDS)} (default: all; "
                        "with --free-run all but kill_engine and stop_engine)")
    parser.add_argument("--slurm", action="store_true", help="on the local Slurm (tools/slurm_local.sh), not cluster=local")
    parser.add_argument("--out", default=None, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run to compare with")
    parser.add_argument("--free-run", action="store_true", help="GRPO free-running (implies --no-reference)")
    parser.add_argument("--experiment", default="quickstart", choices=("quickstart", "quickstart_vl"),
                        help="the recipe under faults (quickstart_vl: images through every path)")
    args = parser.parse_args()
    extra = FREE_RUN if args.free_run else ()
    args.no_reference = args.no_reference or args.free_run
    engine_kinds = ("kill_engine", "stop_engine")  # restarts: lockstep runs only
    every = [k for k in KINDS if not (args.free_run and k in engine_kinds)]
    kinds = [k for k in (args.kinds or ",".join(every)).split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: {unknown or 'none given'}; choose among {list(KINDS)}")
    if args.free_run and set(engine_kinds) & set(kinds):
        parser.error("--free-run: kill_engine and stop_engine need rollout.on_engine_failure=restart, which "
                     "free-running runs refuse; leave them out of --kinds")
    from rich.console import Console
    from rich.table import Table

    from rft.runtime.checkpoint import newest_complete

    console = Console()
    out = args.out or tempfile.mkdtemp(prefix="rft-chaos-")
    os.makedirs(out, exist_ok=True)
    run_dir = os.path.join(out, "run")
    spacing = FREE_RUN_SPACING if args.free_run else SAVE_EVERY
    grpo_steps = spacing * args.faults + 4
    cluster, experiment = "slurm" if args.slurm else "local", args.experiment
    planned = schedule(args.faults, kinds, args.seed, spacing)
    restarts = any(kind in engine_kinds for kind, _, _ in planned)  # rollout.on_engine_failure=restart
    console.print(f"chaos: {args.faults} faults over {grpo_steps} GRPO steps in {run_dir}")

    launches, pending = [], list(planned)
    while True:
        # this launch's faults: the next one, and after a repaired one (corrupt_shard) the next too
        carried: list[tuple[str, int, int | None]] = []
        while pending:
            carried.append(pending.pop(0))
            if not repaired_inside(carried[-1][0], cluster):
                break
        inside = [f"{k}@{s}" + (f"#{r}" if r is not None else "") for k, s, r in carried if k not in OUTSIDE]
        outside = [(k, s) for k, s, _ in carried if k in OUTSIDE]
        env = {**os.environ, "RFT_FAULTS": ",".join(inside)} if inside else dict(os.environ)
        log = os.path.join(out, f"launch{len(launches):02d}.log")
        result = launch(overrides(run_dir, grpo_steps, cluster, extra, restarts, experiment), env, log, outside,
                        run_dir, cluster)
        result["faults"] = carried
        launches.append(result)
        times = fault_times(run_dir)
        ender = carried[-1] if carried else None
        struck = None if ender is None else result["acted_at"] if ender[0] in OUTSIDE else times.get(ender[:2])
        result["detected_s"] = result["ended"] - struck if struck and result["rc"] != 0 else None
        newest = newest_complete(run_dir, [*TRAINERS, ROLLOUT])
        result["checkpoint_after"] = newest.done if newest else 0  # what launching again should resume from
        label = ", ".join(f"{k}@{s}" + (f"#{r}" if r is not None else "") for k, s, r in carried) or "none"
        console.print(f"launch {len(launches) - 1}: faults [{label}] -> exit {result['rc']} after "
                      f"{result['seconds']:.0f} s at step {result['reached']}"
                      + (f" (resumed from {result['resumed_from']})" if result["resumed_from"] else "")
                      + (f"\n  {result['failure'][:160]}" if result["failure"] else ""), markup=False, highlight=False)
        if result["rc"] == 0 and not pending:
            break
        if result["rc"] == 0 and ender and not repaired_inside(ender[0], cluster):
            raise SystemExit(f"launch {len(launches) - 1} finished although {label} should have stopped it; see {log}")
        if len(launches) > 2 * args.faults + 3:
            raise SystemExit(f"no end after {len(launches)} launches; see {out}")

    checks = check_run(run_dir, grpo_steps)
    struck_inside = fault_times(run_dir)
    by_kind: dict[str, dict[str, float]] = {}
    for index, result in enumerate(launches):
        resumed_next = launches[index + 1]["resumed_from"] if index + 1 < len(launches) else None
        ender = result["faults"][-1] if result["faults"] else None
        # the launch ended where its last fault meant it to, not at one that should have been repaired inside
        # it: the script acted, or the run recorded the strike (file_size_limit and corrupt_shard record none)
        ended_by_plan = ender is not None and (result["acted_step"] is not None if ender[0] in OUTSIDE
                                               else tuple(ender[:2]) in struck_inside or ender[0] in UNRECORDED)
        for kind, step, _ in result["faults"]:
            row = by_kind.setdefault(kind, {"injected": 0, "recovered": 0, "steps_repeated": 0, "max_detect_s": 0.0})
            row["injected"] += 1
            if repaired_inside(kind, cluster) and (kind, step) != tuple(ender[:2]):
                row["recovered"] += result["rc"] == 0 or ended_by_plan
            elif (repaired_inside(kind, cluster) and result["rc"] == 0) or resumed_next is not None:
                row["recovered"] += 1
            if (kind, step) == result["faults"][-1][:2] and resumed_next is not None and not repaired_inside(kind, cluster):
                row["steps_repeated"] += max(0, result["reached"] - resumed_next)
                if result["detected_s"] is not None:
                    row["max_detect_s"] = max(row["max_detect_s"], result["detected_s"])

    table = Table(title="chaos: faults by kind")
    for column in ("fault", "injected", "recovered", "steps repeated", "max seconds to exit"):
        table.add_column(column, justify="left" if column == "fault" else "right")
    for kind, row in sorted(by_kind.items()):
        table.add_row(kind, str(row["injected"]), str(row["recovered"]), str(row["steps_repeated"]),
                      f"{row['max_detect_s']:.1f}")
    console.print(table)

    identical = None
    if not args.no_reference:
        from rft.runtime.equivalence import EXPLORER_STATE, TRAINER_STATE, run_differences

        reference = os.path.join(out, "reference")
        console.print(f"the uninterrupted run to compare with: {reference}")
        done = launch(overrides(reference, grpo_steps, cluster, restarts=restarts, experiment=experiment),
                      dict(os.environ), os.path.join(out, "reference.log"), [], reference, cluster)
        if done["rc"] != 0:
            raise SystemExit(f"the uninterrupted run failed; see {out}/reference.log")
        found = run_differences(reference, run_dir, SFT_STEPS + grpo_steps,
                                {0: TRAINER_STATE, 1: TRAINER_STATE, ROLLOUT: EXPLORER_STATE},
                                ("trainer0", f"rollout{ROLLOUT}", "eval"))
        identical = not found
        console.print("identical to the uninterrupted run, bit for bit" if identical else
                      f"{len(found)} differences from the uninterrupted run, e.g. {found[:3]}")
    console.print(f"experience lost: {checks['experience_lost']}, extra: {checks['experience_extra']}, "
                  f"metric gaps: {checks['metric_gaps']}")
    summary = {"faults": len(planned), "launches": len(launches),
               "injected": {k: v["injected"] for k, v in by_kind.items()},
               "recovered": sum(v["recovered"] for v in by_kind.values()),
               "steps_repeated": sum(v["steps_repeated"] for v in by_kind.values()),
               "max_seconds_to_exit": max((v["max_detect_s"] for v in by_kind.values()), default=0.0),
               **checks, "identical_to_uninterrupted": identical, "run_dir": run_dir,
               "launch_records": [{"faults": [f"{k}@{s}" + (f"#{r}" if r is not None else "") for k, s, r in x["faults"]],
                                   "rc": x["rc"], "seconds_to_exit": x["detected_s"], "failure": x["failure"],
                                   "resumed_from": x["resumed_from"], "checkpoint_after": x["checkpoint_after"],
                                   "acted_step": x["acted_step"], "reached": x["reached"]}
                                  for x in launches]}
    print(json.dumps(summary))
    ok = not checks["experience_lost"] and not checks["experience_extra"] and not checks["metric_gaps"]
    sys.exit(0 if ok and identical is not False else 1)


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/chaos.py")  # whatever main starts ends with it
