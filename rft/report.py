"""Launcher-side view of a running job: live progress bar, failure detection, summary table."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rft.data.taskset import file_counts
from rft.monitor import eval_path, progress_path, rank_summary_path, read_jsonl
from rft.runtime.pulse import SILENT_S

console = Console()


@dataclass
class RankFailure:
    rank: int
    log_path: str
    reason: str

    @property
    def died(self) -> bool:
        """Killed by a signal or gone without a result (rft/runtime/supervisor.py's words), rather
        than raising: when one rank dies its peers raise soon after, and the dead one is the cause."""
        return " was killed by " in self.reason or "without a result" in self.reason


def _task_result(log_dir: str, job_id: str, rank: int) -> tuple[str, object] | None:
    path = os.path.join(log_dir, f"{job_id}_{rank}_result.pkl")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # being written right now
        return None


def _exception_line(trace: str) -> str:
    """The `SomeError: message` line of a traceback (messages may span several lines), without
    the exception's module path; a rank killed by a signal (rft/runtime/supervisor.py) is just
    the message."""
    lines = trace.strip().splitlines()
    for line in reversed(lines):
        found = re.match(r"^(?:[\w]+\.)*(\w+(?:Error|Exception|Interrupt|Exit))\b(.*)$", line)
        if found:
            name, rest = found.groups()
            return rest.lstrip(": ") if name == "RankKilledError" else name + rest
    return lines[-1] if lines else "(no traceback)"


def _pid_alive(pid_file: str) -> bool | None:
    if not os.path.exists(pid_file):
        return None
    try:
        os.kill(int(open(pid_file).read().strip()), 0)
        return True
    except (ProcessLookupError, ValueError):
        return False


def local_rank_alive(run_dir: str) -> Callable[[int], bool | None]:
    """Liveness from the pid files the ranks and their supervising tasks write (only meaningful on
    the launcher's machine): alive while either process is."""
    from rft.job import pid_path

    def alive(rank: int) -> bool | None:
        states = [_pid_alive(pid_path(run_dir, rank)), _pid_alive(pid_path(run_dir, rank, supervisor=True))]
        return True if True in states else (None if states == [None, None] else False)

    return alive


def local_rank_processes(run_dir: str, log_dir: str, world_size: int) -> list[tuple[int, int, bool]]:
    """(rank, pid, leads a group) of every live rank process of a local job and of its supervising
    task, from their pid files. Only processes whose command line names this job's log directory
    count, so a pid file left from an earlier attempt never names an unrelated process that reuses
    its number. Taken while the ranks live: a rank's process group (vLLM's engine process, reward
    and tool subprocesses) outlives its leader."""
    from rft.job import pid_path

    found = []
    for rank in range(world_size):
        for path, leads in ((pid_path(run_dir, rank), True), (pid_path(run_dir, rank, supervisor=True), False)):
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if os.path.abspath(log_dir).encode() in f.read():
                        found.append((rank, pid, leads))
            except (OSError, ValueError):
                continue  # gone already, or never started
    return found


def stop_local_ranks(processes: list[tuple[int, int, bool]], wait_s: float = 30.0) -> list[int]:
    """After a local job failed or was interrupted: SIGKILL every rank's process group (the rank
    and what it started, vLLM's engine process included: rft/runtime/supervisor.py) and its
    supervising task, and wait until they are gone. submitit's cancel alone left ranks running (a
    rank ignores SIGTERM, as Slurm's requeue needs): a trainer of the failed launch lived on for
    half a minute and trained on experience the next launch into the same directory had written;
    and where submitit killed a task, its rank's vLLM engine lived on. Returns the ranks stopped."""
    stopped, pids = set(), []
    for rank, pid, leads in processes:
        try:
            if leads:
                os.killpg(pid, signal.SIGKILL)  # the group outlives its leader: kill it by its id
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            continue  # the whole group is gone
        pids.append(pid)
        stopped.add(rank)
    deadline = time.monotonic() + wait_s
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(stopped)


def process_running(pid: int) -> bool:
    """Alive and not a zombie (a killed process its parent has not reaped yet has died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_WARNED: set[str] = set()


def warn_once(text: str) -> None:
    """Print a Slurm tool's warning the first time only (the launcher polls them every few seconds)."""
    text = text.strip()
    if text and text not in _WARNED:
        _WARNED.add(text)
        console.print(f"[yellow]slurm: {escape(text)}", soft_wrap=True)


def _squeue_state(job_id: str) -> str | None:
    """The job's state as squeue shows it ("" once Slurm no longer lists it), None when the
    controller does not answer."""
    import subprocess

    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0 or "Invalid job id" in out.stderr:
        if out.returncode == 0:
            warn_once(out.stderr)
        return out.stdout.strip()
    warn_once(out.stderr)
    return None


def slurm_job_alive(job_id: str) -> Callable[[int], bool | None]:
    """Liveness from the queue: once Slurm no longer lists the job, a rank without a result died.
    (submitit reads job states from sacct, which clusters without accounting lack.)"""
    last: dict[str, float | bool | None] = {"at": -1e9, "verdict": None}

    def alive(_rank: int) -> bool | None:
        if time.monotonic() - last["at"] < 10:  # one squeue per 10 s, not one per rank per poll
            return last["verdict"]
        state = _squeue_state(job_id)
        last.update(at=time.monotonic(), verdict=None if state is None else bool(state))
        return last["verdict"]

    return alive


def slurm_job_state(job_id: str) -> str | None:
    """How Slurm says the job ended, e.g. "OUT_OF_MEMORY, exit code 0:125": from sacct where
    accounting is on, else from scontrol while the controller still remembers the job."""
    import subprocess

    def run(cmd: list[str]) -> str | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    acct = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
    if acct and acct.strip():
        state, _, code = acct.strip().splitlines()[0].partition("|")
        return f"{state}, exit code {code}"
    shown = run(["scontrol", "-o", "show", "job", job_id])
    if shown:
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        if "JobState" in fields:
            reason = f" ({fields['Reason']})" if fields.get("Reason", "None") != "None" else ""
            return f"{fields['JobState']}{reason}, exit code {fields.get('ExitCode', '?')}"
    return None


def job_watch(job, on_slurm: bool, run_dir: str, log_dir: str, world_size: int
              ) -> tuple[Callable[[], bool], Callable[[int], bool | None]]:
    """(done(), alive(rank)) for a submitted job. On Slurm both come from result files and squeue:
    submitit's own `job.done()` runs sacct, which warns on every poll where accounting is off."""
    if not on_slurm:
        return job.done, local_rank_alive(run_dir)
    alive = slurm_job_alive(job.job_id)

    def done() -> bool:
        if all(_task_result(log_dir, job.job_id, r) is not None for r in range(world_size)):
            return True
        return alive(0) is False

    return done, alive


def wait_until_gone(job_id: str, timeout_s: float = 120.0) -> bool:
    """After the ranks returned: wait until Slurm has finished the job too (its epilogue, the
    accounting record), so `cluster.wait=true` exits when `sacct` shows the job ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _squeue_state(job_id) == "":
            return True
        time.sleep(1.0)
    return False


def find_failures(run_dir: str, log_dir: str, job_id: str, world_size: int,
                  alive: Callable[[int], bool | None] | None = None, on_slurm: bool = False) -> list[RankFailure]:
    """The ranks that failed, the first first: one that raised or was killed (submitit's result
    pickle says error; rft/runtime/supervisor.py reports signals), or whose process vanished
    without a result. Ordered by their result files' times: when one rank dies the others often
    fail after it (a peer gone from a meeting), and the first is the cause."""
    alive = alive or local_rank_alive(run_dir)
    failures: list[tuple[float, RankFailure]] = []
    for rank in range(world_size):
        log = os.path.join(log_dir, f"{job_id}_{rank}_log.err")
        result = _task_result(log_dir, job_id, rank)
        if result is not None and result[0] == "error":
            at = os.path.getmtime(os.path.join(log_dir, f"{job_id}_{rank}_result.pkl"))
            failures.append((at, RankFailure(rank, log, _exception_line(str(result[1])))))
        elif result is None and alive(rank) is False:
            time.sleep(1.0)  # the result file may land just after the process exits
            if _task_result(log_dir, job_id, rank) is None:
                reason = "process exited without a result (killed?)"
                state = slurm_job_state(job_id) if on_slurm else None
                if state:
                    reason += f"; Slurm: job {job_id} {state}"
                failures.append((time.time(), RankFailure(rank, log, reason)))
    return [f for _, f in sorted(failures, key=lambda f: f[0])]


def find_failure(run_dir: str, log_dir: str, job_id: str, world_size: int,
                 alive: Callable[[int], bool | None] | None = None, on_slurm: bool = False) -> RankFailure | None:
    """The rank that failed first (see find_failures), if any."""
    return next(iter(find_failures(run_dir, log_dir, job_id, world_size, alive, on_slurm)), None)


class EngineLosses:
    """rollout.on_engine_failure=continue: the failures of engine ranks (`engine_of`: rank ->
    engine index; empty when the job fails fast) are lost engines, said once each, not the job's
    end, unless no engine is left."""

    def __init__(self, engine_of: dict[int, int]):
        self.engine_of, self.lost = engine_of, set()

    def fatal(self, failures: list[RankFailure]) -> RankFailure | None:
        for failure in failures:
            engine = self.engine_of.get(failure.rank)
            if engine is not None and engine not in self.lost:
                self.lost.add(engine)
                console.print(f"[yellow]engine {engine} lost: rank {failure.rank} failed: {escape(failure.reason)}\n  log: "
                              f"{escape(failure.log_path)}\n  the run goes on without it (rollout.on_engine_failure=continue)",
                              soft_wrap=True)
        left = set(self.engine_of.values()) - self.lost
        return next((f for f in failures if f.rank not in self.engine_of or not left), None)


DEATH_REPORT_S = 20.0


def _root_cause(first: RankFailure, losses: EngineLosses, run_dir: str, log_dir: str, job_id: str, world_size: int,
                alive: Callable[[int], bool | None], on_slurm: bool) -> RankFailure:
    """The failure to report, once `first` is seen. A rank killed by a signal reports after its
    supervisor cleaned up and told the job's store (seconds, when the store went down with rank
    0), and a peer's error ("connection reset") often lands first: wait, up to DEATH_REPORT_S,
    until a rank that died reports or every rank has ended, reported or gone silent; a death wins."""
    from rft.job import pid_path
    from rft.runtime.pulse import silent_s

    deadline = time.monotonic() + DEATH_REPORT_S

    def accounted(rank: int) -> bool:  # ended, reported, or stopped (silent: it will never report)
        quiet = silent_s(pid_path(run_dir, rank))
        return alive(rank) is False or _task_result(log_dir, job_id, rank) is not None or \
            (quiet is not None and quiet >= SILENT_S)

    while True:
        failures = find_failures(run_dir, log_dir, job_id, world_size, alive, on_slurm)
        settled = all(accounted(rank) for rank in range(world_size))
        if any(f.died for f in failures) or settled or time.monotonic() > deadline:
            return losses.fatal(sorted(failures, key=lambda f: not f.died)) or first
        time.sleep(0.5)


def silent_rank(run_dir: str, log_dir: str, job_id: str, world_size: int, alive: Callable[[int], bool | None],
                silent_for_s: float, besides: int | None = None) -> tuple[int, float] | None:
    """A rank (not `besides`) whose pulse (rft/runtime/pulse.py) stopped `silent_for_s` ago or
    more although its process has not ended, while another rank's pulse goes on: it is stopped
    (SIGSTOP, a debugger) or hung. (rank, seconds silent). Nobody beating means the job is not
    running (queued again after a requeue, or ending): no rank is blamed then."""
    from rft.job import pid_path
    from rft.runtime.pulse import silent_s

    quiet = {rank: silent_s(pid_path(run_dir, rank)) for rank in range(world_size)}
    if not any(q is not None and q < SILENT_S for q in quiet.values()):
        return None
    for rank, q in quiet.items():
        if rank == besides or q is None or q < silent_for_s or alive(rank) is False:
            continue
        if _task_result(log_dir, job_id, rank) is None:  # one that ended stops beating, too
            return rank, q
    return None


def stopped_responding(rank: int, quiet: float, log_dir: str, job_id: str, name_of: Callable[[int], str],
                       then: RankFailure | None = None) -> RankFailure:
    after = f"; rank {then.rank} then failed: {then.reason}" if then else ""
    return RankFailure(rank, os.path.join(log_dir, f"{job_id}_{rank}_log.err"),
                       f"{name_of(rank)} stopped responding: no heartbeat for {quiet:.0f} s (stopped by a signal or "
                       f"a debugger, hung, or its node is unreachable){after}")


def watch(job, run_dir: str, log_dir: str, world_size: int, show_progress: bool, poll_s: float = 1.0,
          done: Callable[[], bool] | None = None, alive: Callable[[int], bool | None] | None = None,
          on_slurm: bool = False, engine_of: dict[int, int] | None = None,
          name_of: Callable[[int], str] = lambda rank: f"rank {rank}", hang_s: float = 630.0) -> RankFailure | None:
    """Render progress until the job ends; return the first failed rank, if any (a lost engine's
    ranks in `engine_of` are not the job's failure: EngineLosses), or the rank silent for `hang_s`
    while the others beat (`silent_rank`). While it follows, the launcher's ownership of the run
    directory stays fresh (rft/runtime/run_dir.py)."""
    losses = EngineLosses(engine_of or {})
    alive = alive or local_rank_alive(run_dir)
    from rft.runtime.run_dir import HEARTBEAT_S, heartbeat

    done = done or job.done
    progress = Progress(TextColumn("[bold]{task.fields[stage]}"), BarColumn(),
                        TextColumn("step {task.completed}/{task.total}"),
                        TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console,
                        disable=not show_progress)
    beat, shown_endpoints = 0.0, False
    with progress:
        bar = progress.add_task("run", total=None, stage="starting", reward="-")
        while not done():
            if time.monotonic() - beat > HEARTBEAT_S:
                heartbeat(run_dir)
                beat = time.monotonic()
            failure = losses.fatal(find_failures(run_dir, log_dir, job.job_id, world_size, alive, on_slurm))
            if failure is not None:
                failure = _root_cause(failure, losses, run_dir, log_dir, job.job_id, world_size, alive, on_slurm)
                if failure.died:
                    return failure
                # a rank that timed out waiting: the one it waited for may be stopped, or waiting itself
                silent = silent_rank(run_dir, log_dir, job.job_id, world_size, alive, SILENT_S, besides=failure.rank)
                return failure if silent is None else stopped_responding(*silent, log_dir, job.job_id, name_of, failure)
            # no rank failed, but one went silent longer than its peers would wait for it (a stopped
            # rank that hosts the control store leaves them waiting on the store, with no timeout)
            silent = silent_rank(run_dir, log_dir, job.job_id, world_size, alive, hang_s)
            if silent is not None:
                return stopped_responding(*silent, log_dir, job.job_id, name_of)
            endpoints = None if shown_endpoints else _read_json(os.path.join(run_dir, "endpoints.json"))
            if endpoints:  # rollout.openai_api: say where agents can reach the policy, once
                shown_endpoints = True
                urls = ", ".join(e["url"] for e in endpoints["endpoints"])
                console.print(f"OpenAI-compatible endpoint(s): {urls} (model {endpoints['model']}; token and "
                              f"headers in {os.path.join(run_dir, 'endpoints.json')})", soft_wrap=True)
            state = _read_json(progress_path(run_dir))
            if state:
                reward = state.get("reward")
                progress.update(bar, total=state["total_steps"], completed=state["step"],
                                stage=f"{state['stage']} ({state['stage_index'] + 1}/{state['num_stages']})",
                                reward="-" if reward is None else f"{reward:.3f}")
            time.sleep(poll_s)
    return losses.fatal(sorted(find_failures(run_dir, log_dir, job.job_id, world_size, alive, on_slurm),
                               key=lambda f: not f.died))


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def served_line(run_dir: str, world_size: int) -> str:
    """mode=serve's result: sessions written and the weights each engine served last."""
    engines = [r for r in (_read_json(rank_summary_path(run_dir, rank)) for rank in range(world_size)) if r]
    return (f"served {sum(e.get('sessions', 0) for e in engines)} rewarded session(s) into "
            f"{os.path.join(run_dir, 'buffer')}; weights versions served last: {[e.get('version') for e in engines]}")


def build_summary(run_dir: str, world_size: int) -> dict:
    """Eval accuracy at start/end of each stage, time split, skipped rows, reward errors."""
    ranks = [_read_json(rank_summary_path(run_dir, r)) or {} for r in range(world_size)]
    trainer = next((r for r in ranks if r.get("role") == "trainer"), {})
    rollouts = [r for r in ranks if r.get("role") == "rollout"]  # one per engine
    rollout = next(iter(rollouts), {})
    stages: dict[str, dict] = {}
    for row in read_jsonl(eval_path(run_dir)):
        entry = stages.setdefault(row["stage"], {})
        metrics = {k: v for k, v in row.get("metrics", {}).items() if k not in _BOOKKEEPING}
        if row["when"] == "start":
            entry.setdefault("start", row["accuracy"])
            entry.setdefault("metrics_start", metrics)
        entry["end"] = row["accuracy"]
        entry["metrics_end"] = metrics
    wall = max((r.get("wall_s", 0.0) for r in ranks), default=0.0)
    # The trainer's view covers the whole step; the explorer's parts happen while it waits.
    trainer_split = {part: trainer.get(part, 0.0) for part in ("train_s", "sync_s", "buffer_s", "wait_s")}
    trainer_split["other_s"] = max(0.0, trainer.get("wall_s", 0.0) - sum(trainer_split.values()))
    explorer_split = {part: rollout.get(part, 0.0)
                      for part in ("startup_s", "rollout_s", "eval_s", "buffer_s", "sync_wait_s")}
    split = {role: parts for role, parts, ran in (("trainer", trainer_split, trainer), ("explorer", explorer_split,
                                                                                           rollout)) if ran}
    peak = {role: round(parts.get("peak_rss_gb", 0.0), 2)
            for role, parts in (("trainer", trainer), ("rollout", rollout)) if parts}
    return {"stages": stages, "wall_s": wall, "steps": trainer.get("steps", rollout.get("steps", 0)),
            "time_split": split,  # only the roles this mode runs (mode=train: no explorer)
            "skipped_rows": {**trainer.get("skipped_rows", {}), **rollout.get("skipped_rows", {})},
            "peak_rss_gb": peak,  # the largest resident memory of the first rank of each role
            "reward_errors": sum(r.get("reward_errors", 0) for r in rollouts),  # every engine's
            "failed_samples": sum(r.get("failed_samples", 0) for r in rollouts),
            "engines": len(rollouts),
            "engines_lost": trainer.get("engines_lost", {}),  # rank -> how it ended (on_engine_failure=continue)
            **({"judge": {key: sum(r.get(f"judge_{key}", 0) for r in rollouts) for key in ("calls", "timeouts", "errors")}}
               if any("judge_calls" in r for r in rollouts) else {}),
            "failed_path": os.path.join(run_dir, "buffer", "failed.jsonl"),
            "stale": {"dropped": trainer.get("stale_dropped", 0), "reweighted": trainer.get("stale_reweighted", 0)}}


# eval metrics the summary leaves out: counts of what went wrong are reported on their own
_BOOKKEEPING = ("failed_samples", "retries", "timeouts", "reward_errors")


def _eval_rows(entry: dict) -> list[tuple[str, float | None, float | None]]:
    """(what, start, end) for a stage: accuracy (the mean reward), then the workflow's metrics
    (success, ...) and turns or tool calls where an episode has more than one or any."""
    rows = [("accuracy", entry.get("start"), entry.get("end"))]
    first, last = entry.get("metrics_start", {}), entry.get("metrics_end", {})
    for key in sorted(set(first) | set(last)):
        values = [v for v in (first.get(key), last.get(key)) if v is not None]
        if (key == "turns" and all(v == 1.0 for v in values)) or (key == "tool_calls" and not any(values)):
            continue  # single-turn, no tools: nothing to say
        rows.append((key.replace("_", " "), first.get(key), last.get(key)))
    return rows


def _fmt(value: float | None, fraction: bool) -> str:
    return "-" if value is None else (f"{100 * value:.1f}%" if fraction else f"{value:.2f}")


def print_summary(summary: dict) -> None:
    table = Table(title="rft run summary")
    for column in ("stage", "eval"):
        table.add_column(column)
    for column in ("start", "end", "change"):
        table.add_column(column, justify="right")
    for name, entry in summary["stages"].items():
        for what, start, end in _eval_rows(entry):
            known = [v for v in (start, end) if v is not None]
            fraction = all(0.0 <= v <= 1.0 for v in known) and what not in ("turns", "tool calls", "shortest")
            delta = "-" if start is None or end is None else \
                (f"{100 * (end - start):+.1f} pts" if fraction else f"{end - start:+.2f}")
            label = "reward" if what == "accuracy" and not fraction else what  # accuracy: rewards in [0, 1]
            table.add_row(name, label, _fmt(start, fraction), _fmt(end, fraction), delta)
    console.print(table)
    split = Table(title=f"wall time {summary['wall_s']:.1f}s, {summary['steps']} steps")
    split.add_column("rank")
    split.add_column("part")
    split.add_column("seconds", justify="right")
    split.add_column("share of wall", justify="right")
    for role, parts in summary["time_split"].items():
        for part, seconds in parts.items():
            share = seconds / summary["wall_s"] if summary["wall_s"] else 0.0
            split.add_row(role, part.removesuffix("_s").replace("_", " "), f"{seconds:.1f}", f"{100 * share:.0f}%")
    console.print(split)
    if summary.get("peak_rss_gb"):
        console.print("peak memory: " + ", ".join(f"{role} rank {gb:.1f} GiB"
                                                  for role, gb in summary["peak_rss_gb"].items()))
    for path, counts in summary["skipped_rows"].items():
        counts = file_counts(counts)
        for key, what in (("malformed", "skipped {n} malformed rows"),
                          ("overlong_skipped", "skipped {n} rows longer than the model's context (data.overlong=skip)"),
                          ("truncated", "truncated the prompts of {n} rows longer than the model's context")):
            if counts.get(key):
                console.print(f"[yellow]{what.format(n=counts[key])} in {escape(path)}", soft_wrap=True)
    stale = summary.get("stale", {})
    if any(stale.values()):
        console.print(f"[yellow]stale experience (buffer.max_staleness): {stale.get('dropped', 0)} shard(s) dropped, "
                      f"{stale.get('reweighted', 0)} re-weighted")
    for rank, how in summary.get("engines_lost", {}).items():
        console.print(f"[yellow]engine lost: {escape(how.split(': ')[0])}; the run finished on {summary['engines']} engine(s)",
                      soft_wrap=True)
    if summary["reward_errors"]:
        console.print(f"[yellow]{summary['reward_errors']} reward calls failed or timed out (scored 0)")
    judge = summary.get("judge")
    if judge:
        late = f"; [yellow]{judge['timeouts']} timed out, {judge['errors']} failed[/yellow]" \
            if judge["timeouts"] or judge["errors"] else ""
        console.print(f"judge calls: {judge['calls']}{late}")
    if summary.get("failed_samples"):
        console.print(f"[yellow]{summary['failed_samples']} workflow samples failed every try (rollout.max_retries); "
                      f"each is in {summary.get('failed_path', 'buffer/failed.jsonl')} with its traceback", soft_wrap=True)
