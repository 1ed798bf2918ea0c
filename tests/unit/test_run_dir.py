"""One live launch owns a run directory; a dead owner's claim is taken over; an earlier attempt is
moved aside, not mixed with the new one (rft/runtime/run_dir.py). Real processes and real files;
Slurm-job owners are checked against a real Slurm in tests/slurm."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from rft.runtime.run_dir import (
    ATTEMPT_FILES,
    OWNER_FILE,
    Owner,
    RunDirBusy,
    claim,
    has_earlier_attempt,
    release,
    set_aside_attempt,
    this_launch,
)


def _owner_of(process: subprocess.Popen, host: str | None = None) -> Owner:
    with open(f"/proc/{process.pid}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    return Owner(host=host or socket.gethostname(), pid=process.pid, pid_start=start, started="2026-11-23 10:00:00",
                 cluster="local")


def _write_owner(run_dir, owner: Owner) -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / OWNER_FILE).write_text(json.dumps(owner.__dict__))


def test_a_live_launch_keeps_the_directory(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_owner(tmp_path, _owner_of(other))
        with pytest.raises(RunDirBusy) as err:
            claim(str(tmp_path), this_launch("local"))
        message = str(err.value)
        assert f"in use by the launch with pid {other.pid}" in message and "started 2026-11-23 10:00:00" in message
        assert f"kill {other.pid}" in message and "another run.output_dir" in message
    finally:
        other.kill()
        other.wait()


def test_a_dead_launch_is_taken_over(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    other.wait()  # exited: its pid names nobody (or, if reused, a process with another start time)
    _write_owner(tmp_path, Owner(host=socket.gethostname(), pid=other.pid, pid_start="1", started="yesterday",
                                 cluster="local"))
    me = this_launch("local")
    note = claim(str(tmp_path), me)
    assert note and f"launcher pid {other.pid}" in note and "no longer running" in note
    assert json.loads((tmp_path / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert [n for n in os.listdir(tmp_path) if n.startswith(OWNER_FILE)] == [OWNER_FILE]


def test_a_reused_pid_is_not_the_owner(tmp_path):
    """The owner's pid now belongs to an unrelated process (another start time): taken over."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = _owner_of(other)
        stale.pid_start = str(int(stale.pid_start) - 1000)
        _write_owner(tmp_path, stale)
        assert claim(str(tmp_path), this_launch("local")) is not None
    finally:
        other.kill()
        other.wait()


def test_a_launcher_on_another_host_lives_while_it_heartbeats(tmp_path):
    _write_owner(tmp_path, Owner(host="login2", pid=4242, pid_start="7", started="today", cluster="local"))
    with pytest.raises(RunDirBusy, match="on login2"):
        claim(str(tmp_path), this_launch("local"))
    old = time.time() - 600
    os.utime(tmp_path / OWNER_FILE, (old, old))  # no heartbeat for 10 minutes
    assert "login2" in claim(str(tmp_path), this_launch("local"))


def test_sweep_runs_sharing_a_directory_are_named_as_such(tmp_path):
    me = this_launch("local")
    claim(str(tmp_path), me)
    with pytest.raises(RunDirBusy, match="another run of this launch"):
        claim(str(tmp_path), this_launch("local"))


def test_release_removes_only_our_claim(tmp_path):
    me = this_launch("local")
    claim(str(tmp_path), me)
    someone = Owner(host="login2", pid=1, pid_start="", started="later", cluster="local")
    release(str(tmp_path), someone)
    assert (tmp_path / OWNER_FILE).exists()
    release(str(tmp_path), me)
    assert not (tmp_path / OWNER_FILE).exists()


def test_an_earlier_attempt_moves_aside_whole(tmp_path):
    run = tmp_path / "run"
    (run / "buffer").mkdir(parents=True)
    (run / "buffer" / "step00000800-p001.parquet").write_bytes(b"x")
    (run / "tensorboard" / "trainer0").mkdir(parents=True)
    (run / "progress.json").write_text("{}")
    (run / "data").mkdir()  # generated inputs and logs stay
    (run / "logs").mkdir()
    assert has_earlier_attempt(str(run))
    first = set_aside_attempt(str(run))
    assert first == str(run / "attempts" / "1")
    assert sorted(os.listdir(first)) == ["buffer", "progress.json", "tensorboard"]
    assert (run / "attempts" / "1" / "buffer" / "step00000800-p001.parquet").exists()
    assert not has_earlier_attempt(str(run)) and (run / "data").exists() and (run / "logs").exists()
    assert set_aside_attempt(str(run)) is None  # nothing left to move
    (run / "metrics").mkdir()
    assert set_aside_attempt(str(run)) == str(run / "attempts" / "2")
    assert set(ATTEMPT_FILES) >= {"buffer", "metrics", "tensorboard", "checkpoints", "progress.json", "summary.json"}


@pytest.mark.parametrize("override, key, saved", [
    ("cluster.trainer_ranks=2", "cluster.trainer_ranks", 1),  # the rollout rank would become rank 2
    ("trainer.transformer_impl=local", "trainer.transformer_impl", "auto"),
    ("+stages.1.trainer.lora.rank=8", "stages[grpo].trainer.lora.rank", 0),
])
def test_a_resume_into_another_layout_is_refused_naming_the_key(tmp_path, override, key, saved):
    """The launcher compares with the config the earlier launch saved, before any rank loads a
    checkpoint into shards of another shape."""
    from omegaconf import OmegaConf

    from rft.launch.attempts import refuse_another_layout
    from rft.launch.submit import _resolved_config
    from tests.unit.test_config import compose_cfg

    earlier = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}")
    _resolved_config(earlier)  # <run>/config.yaml, as the earlier launch saved it
    refuse_another_layout(compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                                      "trainer.recompute=full"), "attempts/1")  # not a layout: resumes
    changed = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", override)
    with pytest.raises(ValueError, match=f"^{re.escape(key)}=.*saved with {re.escape(key)}={saved}.*run\\.resume=never"):
        refuse_another_layout(changed, "attempts/1")
    older = OmegaConf.load(tmp_path / "config.yaml")  # as an rft without trainer.transformer_impl saved it
    del older.trainer["transformer_impl"]
    OmegaConf.save(older, tmp_path / "config.yaml")
    refuse_another_layout(compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                                      "trainer.transformer_impl=local"), "attempts/1")


def test_a_new_tp_or_pp_is_refused_only_for_a_checkpoint_of_per_rank_tensors(tmp_path):
    """A checkpoint whose trainer tensors are sharded (layout-free) loads into another TP, PP or
    virtual stages; one holding the model or optimizer per rank (saved before sharded checkpoints,
    or Megatron's optimizer on GPUs) is refused, naming the key and the component."""
    from rft.launch.attempts import refuse_another_layout
    from rft.launch.submit import _resolved_config
    from rft.runtime.checkpoint import Resume, save_rank_state
    from tests.unit.test_config import compose_cfg

    _resolved_config(compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}"))
    step_dir = str(tmp_path / "checkpoints" / "step00000010")
    for override in ("trainer.tensor_parallel_size=2", "trainer.pipeline_parallel_size=2"):
        new = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", override)
        save_rank_state(str(tmp_path), 10, 0, {"progress": {}, "__sharded__": {"components": ["model", "optimizer"]}})
        refuse_another_layout(new, "attempts/1", Resume(10, step_dir))  # resharded on load
        save_rank_state(str(tmp_path), 10, 0, {"progress": {}, "model": {"w": 1}, "optimizer": {"state": {}}})
        with pytest.raises(ValueError, match=f"{re.escape(override.split('=')[0])}=2.*holds the model .* per rank"):
            refuse_another_layout(new, "attempts/1", Resume(10, step_dir))
