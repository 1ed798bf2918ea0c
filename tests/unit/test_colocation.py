"""Colocation without running a model: the Slurm layout that puts trainer rank i and rollout rank
T+i on one GPU, the combinations refused with the key to change, the hand-overs through a real
TCP store, the checkpoint engine loading the version being published (not a newer one a crashed
attempt left), and the run summary's colocated parts."""

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from rft.config import RFTConfig
from rft.config.checks import validate
from rft.launch.plan import nodes_line
from rft.launch.report import build_summary
from rft.launch.slurm import check_request, make_executor, node_of, tasks_per_node
from rft.runtime.colocation import Turns
from rft.runtime.monitor import rank_summary_path, write_json_atomic
from rft.runtime.topology import Topology, engine_devices
from rft.weights.engines import SyncLayout, make_receiver, make_sender, sync_layout
from rft.weights.group import PeerTimeoutError
from tests.unit.test_config import compose_cfg

TABLE = [(f"model.layers.{i}.mlp.down_proj.weight", (1024,), "torch.float32") for i in range(3)]


def _colocated_gpu_job(tmp_path) -> RFTConfig:
    cfg = RFTConfig()
    cfg.run.output_dir = str(tmp_path)
    c = cfg.cluster
    c.kind, c.nodes, c.gpus_per_node, c.trainer_ranks, c.rollout_ranks, c.colocate = "slurm", 2, 4, 8, 8, True
    return cfg


def _plane_local_ids(cfg: RFTConfig) -> dict[int, tuple[int, int]]:
    """(node, SLURM_LOCALID) of each global rank as srun --distribution=plane=G places them."""
    seen: dict[int, int] = {}
    placed = {}
    for rank in range(cfg.cluster.trainer_ranks + cfg.cluster.rollout_ranks):
        node = (rank // cfg.cluster.gpus_per_node) % cfg.cluster.nodes
        placed[rank] = (node, seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    return placed


def test_a_colocated_gpu_job_puts_trainer_i_and_rollout_t_plus_i_on_one_gpu(tmp_path, monkeypatch):
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}:{os.environ['PATH']}")
    cfg = _colocated_gpu_job(tmp_path)
    check_request(cfg)
    assert tasks_per_node(cfg) == 8  # two tasks per GPU
    executor = make_executor(cfg, str(tmp_path / "logs"))
    script = executor._make_submission_file_text(executor._submitit_command_str, "JOBID")
    assert "--distribution=plane=4" in next(line for line in script.splitlines() if line.startswith("srun "))
    placed = _plane_local_ids(cfg)
    gpus = {}
    for rank, (node, local) in placed.items():
        assert node_of(cfg, rank) == node
        for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NTASKS": 16,
                           "SLURM_JOB_NUM_NODES": 2, "SLURM_NODEID": node, "SLURM_JOB_NODELIST": "gpu[1-2]",
                           "SLURM_PROCID": rank, "SLURM_LOCALID": local}.items():
            monkeypatch.setenv(key, str(value))
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        monkeypatch.setattr("rft.runtime.rendezvous.slurm_node_addr", lambda node: "10.0.0.1")
        monkeypatch.setattr("rft.runtime.topology.bind_gloo_towards", lambda addr: None)
        info = Topology.from_env(cfg, master_port=0)
        if info.role == "rollout":
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
            gpus[rank] = (node, engine_devices(cfg.cluster, info.engine_span))
        else:
            gpus[rank] = (node, os.environ["LOCAL_RANK"])  # the trainer's torch.cuda.set_device
    assert all(gpus[i] == gpus[8 + i] for i in range(8)), gpus
    assert len(set(gpus.values())) == 8  # every GPU of both nodes, each shared by one pair
    assert nodes_line(cfg).splitlines()[:2] == ["node 0: ranks 0-3, 8-11 (trainer, rollout)",
                                                "node 1: ranks 4-7, 12-15 (trainer, rollout)"]
    # NCCL cannot join two processes on one GPU: the weights go through the checkpoint engine
    assert sync_layout(cfg, Topology.of(cfg), on_gpu=True).engine == "checkpoint"


@pytest.mark.parametrize("change, key", [
    ({"sync.offset": 1}, "sync.offset"),
    ({"cluster.rollout_ranks": 2}, "cluster.rollout_ranks"),
    ({"cluster.judge_ranks": 1}, "cluster.judge_ranks"),
    ({"sync.engine": "nccl"}, "sync.engine"),
    ({"mode": "train"}, "cluster.colocate"),
    ({"rollout.sleep_level": 3}, "rollout.sleep_level"),
    # level 2 drops the weights at each sleep; only a sync brings them back
    ({"rollout.sleep_level": 2, "sync.interval": 2}, "rollout.sleep_level"),
    # a cut request would resume inside the weight load, before the KV cache wakes
    ({"rollout.partial_rollout": True}, "rollout.partial_rollout"),
])
def test_combinations_colocation_cannot_run_are_refused_naming_the_key(tmp_path, change, key):
    cfg = compose_cfg("+experiment=quickstart", "cluster=local", "cluster.colocate=true", f"run.output_dir={tmp_path}",
                      *[f"{k}={v}" for k, v in change.items()])
    with pytest.raises(ValueError, match=rf"^{key}="):
        validate(cfg)


def test_the_quickstart_colocated_is_valid(tmp_path):
    validate(compose_cfg("+experiment=quickstart", "cluster=local", "cluster.colocate=true", f"run.output_dir={tmp_path}"))


def test_the_trainer_waits_for_each_engine_to_sleep_and_names_the_one_that_did_not(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    turns = Turns(store, engines=2, timeout_s=1.0)
    turns.asleep(0, 7)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after generating step 7; not heard from: colocate/asleep/1/7 "):
        turns.wait_asleep(7)
    # its own 1 s timeout, not the store's 5 s: 1.01 s measured (2 cores under load), the bound 4 x that
    assert time.monotonic() - start < 4
    turns.asleep(1, 7)
    turns.wait_asleep(7)  # both asleep: the trainer's turn


def test_the_checkpoint_engine_loads_the_version_published_not_a_newer_one_left_by_a_crash(tmp_path):
    layout = SyncLayout(engine="checkpoint", host="127.0.0.1", port=0, sender_ranks=[0],
                        receiver_names=["rollout rank 1 worker 0"], timeout_s=5.0, bucket_bytes=1 << 20,
                        checkpoint_dir=str(tmp_path / "weights"))

    def weights(value: float):
        return ((name, torch.full(shape, value)) for name, shape, _ in TABLE)

    crashed = make_sender(layout, 0)
    for version in (4, 5, 6):  # the attempt that crashed after step 6 had published up to 6
        crashed.send(TABLE, weights(float(version)), version)
    got: dict[str, torch.Tensor] = {}
    version, _ = make_receiver(layout, 0).receive(lambda named: got.update(named), version=5)
    assert version == 5 and all(torch.equal(t, torch.full_like(t, 5.0)) for t in got.values())
    # the resumed run (from the checkpoint at step 5) republishes 5: the crashed attempt's 6 goes
    make_sender(layout, 0).send(TABLE, weights(5.0), 5)
    assert sorted(os.listdir(layout.checkpoint_dir)) == ["v000005"]  # (4 was pruned when 6 was written)
    impatient = SyncLayout(**{**layout.as_dict(), "timeout_s": 0.3})
    with pytest.raises(PeerTimeoutError, match="version 6 did not appear"):
        make_receiver(impatient, 0).receive(lambda named: None, version=6)


def test_the_summary_shows_the_colocated_parts(tmp_path):
    os.makedirs(tmp_path / "metrics")
    write_json_atomic(rank_summary_path(str(tmp_path), 0), {"role": "trainer", "wall_s": 10.0, "train_s": 4.0,
                                                            "sync_s": 1.0, "turn_wait_s": 3.0, "steps": 2})
    write_json_atomic(rank_summary_path(str(tmp_path), 1), {"role": "rollout", "wall_s": 10.0, "rollout_s": 3.0,
                                                            "sync_wait_s": 5.0, "sleep_s": 0.5, "wake_s": 1.5,
                                                            "wake_in_sync_s": 1.0})
    split = build_summary(str(tmp_path), 2)["time_split"]
    assert split["trainer"]["turn_wait_s"] == 3.0
    assert (split["explorer"]["sleep_s"], split["explorer"]["wake_s"]) == (0.5, 1.5)
    assert split["explorer"]["sync_wait_s"] == 4.0  # the wakes around the weight load count as wake


def test_disjoint_runs_show_no_colocated_parts(tmp_path):
    os.makedirs(tmp_path / "metrics")
    write_json_atomic(rank_summary_path(str(tmp_path), 0), {"role": "trainer", "wall_s": 10.0, "train_s": 4.0})
    write_json_atomic(rank_summary_path(str(tmp_path), 1), {"role": "rollout", "wall_s": 10.0, "rollout_s": 3.0})
    split = build_summary(str(tmp_path), 2)["time_split"]
    assert "turn_wait_s" not in split["trainer"] and not {"sleep_s", "wake_s"} & set(split["explorer"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
