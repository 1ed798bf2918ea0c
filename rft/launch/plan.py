"""The plan the launcher prints before it submits: ranks, engines, schedule, stages, checkpoints,
and where the outputs go."""

from __future__ import annotations

import os

from rft.config import RFTConfig


def print_plan(cfg: RFTConfig, log_dir: str, attempt: str | None = None) -> None:
    from rich.table import Table

    from rft.config import context_length, stage_configs
    from rft.launch.console import console

    t, r = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    table = Table(title=f"rft plan: {cfg.run.name} on cluster={cfg.cluster.kind}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # long paths wrap, never cut to "..." (logs are 80 columns wide)
    if cfg.mode == "bench":
        from rft.explorer.bench import bench_checkpoints

        table.add_row("mode", f"bench: pass@k / mean@k for k in {list(cfg.bench.k)} on {cfg.data.eval_path}")
        table.add_row("checkpoints", "\n".join(bench_checkpoints(cfg)))
        table.add_row("output dir", cfg.run.output_dir)
        if attempt is not None:
            table.add_row("attempt", attempt)
        console.print(table)
        return
    if cfg.mode == "serve":
        table.add_row("mode", "serve: vLLM's OpenAI API on every engine; rewarded sessions -> <run>/buffer every "
                              f"{cfg.serve.step_s:g}s" + (f", for {cfg.serve.duration_min:g} min" if cfg.serve.duration_min
                                                        else ", until cancelled"))
        table.add_row("engines", engines_line(cfg))
        table.add_row("weights", f"{cfg.model.path}, then each version a trainer publishes to {cfg.sync.checkpoint_dir}"
                      if cfg.sync.checkpoint_dir else f"{cfg.model.path} (fixed; set sync.checkpoint_dir to follow "
                                                       "a trainer's sync.engine=checkpoint)")
        table.add_row("output dir", cfg.run.output_dir)
        table.add_row("logs", log_dir)
        console.print(table)
        return
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    t = 0 if cfg.mode == "explore" else t  # the ranks this mode runs (Topology.of)
    if cfg.mode != "explore":
        table.add_row("trainer ranks", f"{list(range(t))}  (Megatron TP={tp} PP={pp} DP={t // (tp * pp)})")
    if cfg.mode != "train":
        table.add_row("rollout ranks", f"{list(range(t, t + r))}  (vLLM TP={cfg.rollout.tensor_parallel_size}, "
                                       f"model {cfg.model.name}, {kv_cache_note(cfg)})")
    if cfg.sync.decoupled:
        table.add_row("decoupled", decoupled_line(cfg))
    if cfg.mode in ("both", "explore") and r:
        table.add_row("engines", engines_line(cfg))
    if cfg.cluster.colocate:
        table.add_row("colocated", colocation_line(cfg))
    if cfg.cluster.allocation:
        table.add_row("allocation", f"the ranks run as a step (srun) of job {cfg.cluster.allocation}, on "
                                    f"{cfg.cluster.nodes} of its nodes; no new job is queued")
    if cfg.cluster.kind == "slurm" and cfg.cluster.nodes > 1:
        table.add_row("nodes", nodes_line(cfg))
    if cfg.cluster.kind == "local" and cfg.cluster.gpus_per_node:
        table.add_row("GPUs", gpus_line(cfg))
    if cfg.mode in ("both", "explore") and cfg.cluster.judge_ranks:
        first = t + r if cfg.mode == "both" else r
        table.add_row("judge ranks", f"{list(range(first, first + cfg.cluster.judge_ranks))}  (frozen vLLM, "
                                     f"TP={cfg.judge.tensor_parallel_size}, model {cfg.judge.model or cfg.model.path}; "
                                     f"calls time out after {cfg.judge.timeout_s:g}s)")
    engine = cfg.sync.engine if cfg.sync.engine != "auto" or not cfg.cluster.colocate else \
        f"checkpoint (colocated) at {cfg.sync.checkpoint_dir or os.path.join(cfg.run.output_dir, 'weights')}"
    if cfg.mode == "both":  # one role alone moves no weights (decoupled jobs: their row above)
        table.add_row("weight sync", f"engine {engine}, {cfg.sync.bucket_mb} MiB buckets, timeout {cfg.sync.timeout_s:.0f}s"
                      + wire_note(cfg))
        table.add_row("schedule", schedule_line(cfg))
    context, stages = context_length(cfg.model), stage_configs(cfg)
    table.add_row("stages", ", ".join(f"{n}: {s.algorithm.name} x {s.trainer.max_steps} steps" for n, s in stages))
    # a packed microbatch holds its budget, or one row up to the context if a row is longer
    tokens = max(max(s.trainer.max_tokens_per_microbatch, context) if s.trainer.max_tokens_per_microbatch
                 else max(s.trainer.micro_batch_size, 1) * context for _, s in stages)
    table.add_row("sequences", f"<= {context} tokens (prompt + response; longer rows: data.overlong="
                               f"{cfg.data.overlong}); a trainer microbatch <= {tokens} tokens")
    if cfg.mode != "explore":
        save = [f"every {cfg.trainer.save_every_min:g} min"] if cfg.trainer.save_every_min else []
        save += [f"every {cfg.trainer.save_interval} steps"] if cfg.trainer.save_interval else []
        table.add_row("checkpoints", " and ".join(save + ["on Slurm's time-limit signal and SIGTERM"]) + ", "
                      f"newest {cfg.trainer.keep_checkpoints} kept")
    if cfg.cluster.kind == "slurm":
        table.add_row("on SIGTERM", sigterm_line(cfg))
    table.add_row("output dir", cfg.run.output_dir)
    if attempt is not None:
        table.add_row("attempt", attempt)
    table.add_row("logs", log_dir)
    table.add_row("tensorboard", f"tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}")
    console.print(table)


# what one trainer rank writes per second to the run's filesystem, for a save not measured yet (an
# order of magnitude of one client of a parallel filesystem; measured saves replace it)
WRITE_GB_S = 1.0


def sigterm_line(cfg: RFTConfig) -> str:
    """What a preemption or `scancel` (SIGTERM, then SIGKILL) costs: the step in progress and a save
    (rft/runtime/preemption.py), against the seconds Slurm gives between the two signals."""
    from rft.config.memory_checks import checkpoint_bytes_per_rank, parameter_count
    from rft.config.model import hf_config_json
    from rft.launch.slurm import kill_delays_s
    from rft.runtime.checkpoint import save_timing

    kill_wait, grace = kill_delays_s(cfg.cluster.partition)
    measured = save_timing(cfg.run.output_dir)
    if measured is not None and measured.get("step_s") is not None:
        needs = measured["save_s"] + measured["step_s"]
        cost = (f"the last save took {measured['save_s']:.1f} s after a {measured['step_s']:.1f} s step "
                f"(checkpoint of step {measured['step']})")
    else:
        config = hf_config_json(cfg.model) if cfg.mode != "explore" else None
        parameters = parameter_count(config) if config else None
        needs = checkpoint_bytes_per_rank(cfg, parameters) / 1e9 / WRITE_GB_S if parameters else None
        cost = ("a save not measured yet" + (f": about {needs * WRITE_GB_S:.1f} GB per trainer rank, {needs:.0f} s at "
                                               f"{WRITE_GB_S:g} GB/s, after the step in progress" if needs else ""))
    windows = {}
    if kill_wait is not None:
        windows["scancel"] = kill_wait
        if grace is not None:
            windows["preemption"] = grace + kill_wait
    allows = ", ".join(f"{seconds} s after a {what}" for what, seconds in windows.items()) or "(scontrol did not say)"
    requeue = ("Slurm requeues a preempted job, which resumes there" if cfg.cluster.requeue else
               "a preempted job is not requeued (cluster.requeue=false): launch again to resume")
    line = (f"every rank finishes its step, saves and stops; {requeue}. Slurm kills {allows} "
            f"(KillWait, partition GraceTime); {cost}")
    short = [what for what, seconds in windows.items() if needs is not None and needs > seconds]
    if short:
        line += (f"\n[yellow]may not fit before a {' or a '.join(short)}'s SIGKILL: the steps since the last checkpoint "
                 "would be lost. Ask the site for a longer GraceTime, save more often (trainer.save_every_min), "
                 "and stop a run with `scancel --signal=TERM <job>` (no SIGKILL follows)[/yellow]")
    return line


def kv_cache_note(cfg: RFTConfig) -> str:
    """What sizes each engine's KV cache (rft/explorer/vllm_engine.py's memory_kwargs)."""
    from rft.config.rollout import CPU_KV_CACHE_GB

    gib = cfg.rollout.kv_cache_gb
    if cfg.cluster.gpus_per_node:
        share = f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization:g} of each GPU"
        return (f"KV cache {gib:g} GiB per GPU (rollout.kv_cache_gb), in {share}" if gib is not None else
                f"KV cache: what the weights leave of {share}")
    return f"KV cache {CPU_KV_CACHE_GB if gib is None else gib:g} GiB of RAM (rollout.kv_cache_gb)"


def wire_note(cfg: RFTConfig) -> str:
    """What the plan says where weights travel in another dtype than vLLM runs in."""
    from rft.config import wire_dtype

    wire = wire_dtype(cfg)
    if wire == cfg.model.dtype:
        return ""
    return (f"\n[yellow]weights travel in {wire} (sync.wire_dtype) and vLLM runs {cfg.model.dtype} (model.dtype): the "
            "engine samples from rounded weights, not the ones trained[/yellow]")


def decoupled_line(cfg: RFTConfig) -> str:
    """What this half of a decoupled run (rft/runtime/decoupled.py) takes from the other and gives it."""
    from rft.runtime.decoupled import OTHER_JOB

    other, lead = OTHER_JOB[cfg.mode], cfg.buffer.max_staleness
    if cfg.mode == "explore":
        return (f"this job explores; {other} trains. Shards -> {cfg.buffer.path}, each started within {lead} trainer "
                f"step(s) of its weights (buffer.max_staleness); weights: the newest version in {cfg.sync.checkpoint_dir}")
    return (f"this job trains; {other} explores. Shards <- {cfg.buffer.path}; weights -> {cfg.sync.checkpoint_dir} every "
            f"{cfg.sync.interval} step(s). Each job waits for the other at most {cfg.buffer.wait_timeout_s:.0f}s "
            "(buffer.wait_timeout_s)")


def nodes_line(cfg: RFTConfig) -> str:
    """Which ranks each node of the allocation runs (rft/launch/slurm.py's node_of)."""
    from rft.launch.slurm import node_of
    from rft.runtime.topology import Topology

    lines, world = [], Topology.of(cfg).world_size
    for node in range(cfg.cluster.nodes):
        ranks = [rank for rank in range(world) if node_of(cfg, rank) == node]
        if not ranks:
            break
        roles = dict.fromkeys(Topology.of(cfg, rank).role for rank in ranks)
        lines.append(f"node {node}: {rank_ranges(ranks)} ({', '.join(roles)})")
    return "\n".join(lines) + "\n(rank 0 hosts the rendezvous at the first node's Slurm address)"


def gpus_line(cfg: RFTConfig) -> str:
    """The GPU each rank of a local run on a GPU node takes (rft/launch/local_gpus.py)."""
    from rft.launch.local_gpus import rank_gpus

    lines = [f"rank {rank} ({role}): GPU {','.join(gpus)}" for rank, role, gpus in rank_gpus(cfg)]
    shared = " (colocated: rollout rank T+i on trainer rank i's)" if cfg.cluster.colocate else ""
    return "\n".join(lines) + f"\n(of this node's CUDA_VISIBLE_DEVICES{shared})"


def rank_ranges(ranks: list[int]) -> str:
    """"rank 3", "ranks 0-3" or "ranks 0-3, 8-11" (colocated nodes hold two runs of ranks)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def engines_line(cfg: RFTConfig) -> str:
    """One line per vLLM engine: its ranks and the node of the allocation they run on."""
    from rft.launch.slurm import node_of
    from rft.runtime.topology import Topology

    lines = []
    for e, ranks in enumerate(Topology.of(cfg).engine_ranks):
        where = f"node {node_of(cfg, ranks[0])} of {cfg.cluster.nodes}" if cfg.cluster.kind == "slurm" else "this machine"
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        lines.append(f"engine {e}: {span} on {where}")
    deal = "tasks dealt by load" if len(lines) > 1 else "one engine"
    return "\n".join(lines) + f"\n({deal}; each writes its own shards)"


def colocation_line(cfg: RFTConfig) -> str:
    """Which ranks share a GPU and how they take turns (rft/runtime/colocation.py)."""
    t, gpus = cfg.cluster.trainer_ranks, cfg.cluster.gpus_per_node
    pairs = ", ".join(f"{i}+{t + i}" for i in range(min(t, 4))) + (", ..." if t > 4 else "")
    device = "a GPU" if gpus else "their devices (vLLM's sleep frees nothing on CPU)"
    return (f"ranks {pairs} share {device}, taking turns: vLLM sleeps (level {cfg.rollout.sleep_level}) while "
            "the trainer trains, wakes for the new weights, then generates")


def schedule_line(cfg: RFTConfig) -> str:
    """How explorer and trainer interleave in rollout stages (rft/runtime/schedule.py), and the staleness
    that allows, with a warning where buffer.max_staleness will drop or re-weight shards by design."""
    from rft.runtime.schedule import max_lag

    k, n, limit = cfg.sync.offset, cfg.sync.interval, cfg.buffer.max_staleness
    kind = "synchronous on-policy" if k == 0 and n == 1 else ("one-step-off" if (k, n) == (1, 1) else "asynchronous")
    line = f"{kind}: weights sync every {n} step(s), explorer {k} step(s) ahead; experience up to {max_lag(cfg)} " \
           "trainer step(s) old"
    if limit is not None:
        line += f"; older than {limit}: {cfg.buffer.stale}"
        if limit < max_lag(cfg):
            line += " [yellow](every sync window: sync.offset + sync.interval - 1 > buffer.max_staleness)[/yellow]"
    return line
