"""The launcher's view of a running job: live progress bar until it ends or a rank fails
(rft/launch/failures.py says which and why), and the summary tables at the end."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable

from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rft.data.taskset import file_counts
from rft.launch.console import console
from rft.launch.failures import (EngineLosses, RankFailure, cut_off_from_rank0, cut_off_rank, find_failures, root_cause,
                                 silent_rank, stopped_responding)
from rft.launch.job_state import local_rank_alive
from rft.runtime.monitor import eval_path, progress_path, rank_summary_path
from rft.runtime.storage import read_jsonl
from rft.runtime.pulse import PULSE_S, SILENT_S


def watch(job, run_dir: str, log_dir: str, world_size: int, show_progress: bool, poll_s: float = 1.0,
          done: Callable[[], bool] | None = None, alive: Callable[[int], bool | None] | None = None,
          on_slurm: bool = False, engine_of: dict[int, int] | None = None,
          name_of: Callable[[int], str] = lambda rank: f"rank {rank}", hang_s: float = 630.0,
          cut_s: float = 600.0, on_stage_end: Callable[[str], object] | None = None) -> RankFailure | None:
    """Render progress until the job ends; return the first failed rank, if any (a lost engine's
    ranks in `engine_of` are not the job's failure: EngineLosses), the rank silent for `hang_s`
    while the others beat (`silent_rank`), or the one rank 0 has not answered for `cut_s`
    (`cut_off_rank`: a network partition). While it follows, the launcher's ownership of the run
    directory stays fresh (rft/runtime/run_dir.py); `on_stage_end(name)` runs as the next stage starts."""
    losses = EngineLosses(engine_of or {})
    alive = alive or local_rank_alive(run_dir)
    from rft.runtime.run_dir import HEARTBEAT_S, heartbeat

    done = done or job.done
    progress = Progress(TextColumn("[bold]{task.fields[stage]}"), BarColumn(),
                        TextColumn("step {task.completed}/{task.total}"),
                        TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console,
                        disable=not show_progress)
    beat, shown_endpoints, stage_seen = 0.0, False, None
    with progress:
        bar = progress.add_task("run", total=None, stage="starting", reward="-")
        while not (done() or losses.rest_finished(log_dir, job.job_id, world_size)):
            if time.monotonic() - beat > HEARTBEAT_S:
                heartbeat(run_dir)
                beat = time.monotonic()
            failure = losses.fatal(find_failures(run_dir, log_dir, job.job_id, world_size, alive, on_slurm))
            if failure is not None:
                failure = root_cause(failure, losses, run_dir, log_dir, job.job_id, world_size, alive, on_slurm)
                if failure.died:
                    return failure
                # a rank that timed out waiting: the one it waited for may be cut off, stopped, or waiting itself
                silent = silent_rank(run_dir, log_dir, job.job_id, world_size, alive, SILENT_S,
                                     besides={failure.rank} | losses.lost_ranks)
                if silent is not None:
                    return stopped_responding(*silent, log_dir, job.job_id, name_of, failure)
                cut = cut_off_rank(run_dir, world_size, PULSE_S, besides=losses.engine_of)
                return failure if cut is None else cut_off_from_rank0(*cut, log_dir, job.job_id, name_of, failure)
            # an engine the run may lose whose pulse stopped (its node crashed or dropped off the
            # network): lost, as rank 0 marks it (rft/runtime/membership.py's PulseWatch)
            while (silent := silent_rank(run_dir, log_dir, job.job_id, world_size, alive, SILENT_S,
                                         besides=losses.lost_ranks, among=losses.engine_of)) is not None:
                failure = losses.fatal([stopped_responding(*silent, log_dir, job.job_id, name_of)])
                if failure is not None:
                    return failure
            # no rank failed, but one went silent or lost the network longer than its peers would
            # wait for it (a stopped rank that hosts the control store leaves them waiting on the
            # store, with no timeout)
            silent = silent_rank(run_dir, log_dir, job.job_id, world_size, alive, hang_s, besides=losses.lost_ranks)
            if silent is not None:
                return stopped_responding(*silent, log_dir, job.job_id, name_of)
            cut = cut_off_rank(run_dir, world_size, cut_s, besides=losses.engine_of)
            if cut is not None:
                return cut_off_from_rank0(*cut, log_dir, job.job_id, name_of)
            endpoints = None if shown_endpoints else _read_json(os.path.join(run_dir, "endpoints.json"))
            if endpoints:  # rollout.openai_api: say where agents can reach the policy, once
                shown_endpoints = True
                urls = ", ".join(e["url"] for e in endpoints["endpoints"])
                console.print(f"OpenAI-compatible endpoint(s): {urls} (model {endpoints['model']}; token and "
                              f"headers in {os.path.join(run_dir, 'endpoints.json')})", soft_wrap=True)
            state = _read_json(progress_path(run_dir))
            if state:
                if on_stage_end is not None and stage_seen not in (None, state["stage"]):
                    on_stage_end(stage_seen)  # its plots: a long run shows each stage as it ends
                stage_seen, reward = state["stage"], state.get("reward")
                progress.update(bar, total=state["total_steps"], completed=state["step"],
                                stage=f"{state['stage']} ({state['stage_index'] + 1}/{state['num_stages']})",
                                reward="-" if reward is None else f"{reward:.3f}")
            _sleep_unless_ended(job, poll_s)
    return losses.fatal(sorted(find_failures(run_dir, log_dir, job.job_id, world_size, alive, on_slurm),
                               key=lambda f: not f.died))


def _sleep_unless_ended(job, seconds: float) -> None:
    """Sleep `seconds`, or until a local job's controller process ends, whichever comes first: a
    finished run's summary then follows its last rank at once, not up to a poll later."""
    process = getattr(job, "_process", None)  # submitit's LocalJob; a Slurm job has none here
    if process is None:
        time.sleep(seconds)
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=seconds)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def served_line(run_dir: str, world_size: int, buffer_root: str) -> str:
    """mode=serve's result: sessions written (into `buffer_root`) and the weights each engine served last."""
    engines = [r for r in (_read_json(rank_summary_path(run_dir, rank)) for rank in range(world_size)) if r]
    return (f"served {sum(e.get('sessions', 0) for e in engines)} rewarded session(s) into "
            f"{buffer_root}; weights versions served last: {[e.get('version') for e in engines]}")


def build_summary(run_dir: str, world_size: int, buffer_root: str | None = None) -> dict:
    """Eval accuracy at start/end of each stage, time split, skipped rows, reward errors.
    `buffer_root`: the run's buffer.path, where failed samples are listed (default <run>/buffer)."""
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
    # colocated (rft/runtime/colocation.py): the trainer's wait for the engines to sleep, their sleeps and wakes
    turns = tuple(part for part in ("turn_wait_s",) if part in trainer)
    trainer_split = {part: trainer.get(part, 0.0) for part in ("train_s", "sync_s", "buffer_s", "wait_s", *turns)}
    trainer_split["other_s"] = max(0.0, trainer.get("wall_s", 0.0) - sum(trainer_split.values()))
    sleeps = tuple(part for part in ("sleep_s", "wake_s") if part in rollout)
    explorer_split = {part: rollout.get(part, 0.0)
                      for part in ("startup_s", "rollout_s", "eval_s", "buffer_s", "sync_wait_s", *sleeps)}
    explorer_split["sync_wait_s"] -= rollout.get("wake_in_sync_s", 0.0)  # shown as wake
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
            "engine_restarts": sum(r.get("engine_restarts", 0) for r in rollouts),  # on_engine_failure=restart
            "engines_lost": trainer.get("engines_lost", {}),  # rank -> how it ended (on_engine_failure=continue)
            "models": trainer.get("models", {}),  # stage -> its final model (an HF directory; trainer.save_model)
            **({"judge": {key: sum(r.get(f"judge_{key}", 0) for r in rollouts) for key in _JUDGE_COUNTS}}
               if any("judge_calls" in r for r in rollouts) else {}),
            "failed_path": os.path.join(buffer_root or os.path.join(run_dir, "buffer"), "failed.jsonl"),
            "stale": {"dropped": trainer.get("stale_dropped", 0), "reweighted": trainer.get("stale_reweighted", 0)}}


# the judge's counts, summed over the engines (rft/explorer/judge.py)
_JUDGE_COUNTS = ("calls", "timeouts", "errors", "parse_failures")

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


def print_models(models: dict[str, str]) -> None:
    """Where each stage left its model; the last is also <run>/model."""
    *earlier, (last_stage, last) = models.items()
    run_dir = os.path.dirname(os.path.dirname(last))
    console.print(f"model: {escape(os.path.join(run_dir, 'model'))} (stage {escape(last_stage)}; an HF directory: "
                  "transformers, vLLM, mode=bench)", soft_wrap=True)
    for stage, path in earlier:
        console.print(f"       {escape(path)} (stage {escape(stage)})", soft_wrap=True)


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
    if table.row_count:
        console.print(table)
    else:  # mode=train of RL stages: a decoupled run's explorer job evaluates
        console.print("no evaluations in this job: the explorer evaluates (for a decoupled run, the mode=explore job)")
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
    if summary.get("models"):
        print_models(summary["models"])
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
    if summary.get("engine_restarts"):
        console.print(f"[yellow]engine restarts: {summary['engine_restarts']} (rollout.on_engine_failure=restart); "
                      "each rank's log says why and how long each took", soft_wrap=True)
    if summary["reward_errors"]:
        console.print(f"[yellow]{summary['reward_errors']} reward calls failed or timed out (scored 0)")
    judge = summary.get("judge")
    if judge:
        late = f"; [yellow]{judge['timeouts']} timed out, {judge['errors']} failed[/yellow]" \
            if judge["timeouts"] or judge["errors"] else ""
        if judge.get("parse_failures"):  # relative_judge's replies it could not read in full
            late += f"; [yellow]{judge['parse_failures']} unparsed[/yellow]"
        console.print(f"judge calls: {judge['calls']}{late}")
    if summary.get("failed_samples"):
        console.print(f"[yellow]{summary['failed_samples']} workflow samples failed every try (rollout.max_retries); "
                      f"each is in {summary.get('failed_path', 'buffer/failed.jsonl')} with its traceback", soft_wrap=True)
