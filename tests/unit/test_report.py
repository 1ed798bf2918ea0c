"""What the launcher says about a failed job: the rank that failed first (not the peers that
failed after it), its exception without module paths, a killed rank as the supervisor's message."""

import os
import pickle
import time

import pytest

from rft.launch.failures import RankFailure, _exception_line, find_failure


def _result(log_dir, job, rank, trace, at):
    path = os.path.join(log_dir, f"{job}_{rank}_result.pkl")
    with open(path, "wb") as f:
        pickle.dump(("error", trace), f)
    os.utime(path, (at, at))


def test_exception_line_drops_module_paths_and_the_killed_class():
    trace = "Traceback (most recent call last):\n  File x\nrft.buffer.shards.ShardCorruptError: shard a is corrupt\n"
    assert _exception_line(trace) == "ShardCorruptError: shard a is corrupt"
    killed = "Traceback...\nrft.runtime.supervisor.RankKilledError: trainer rank 0 was killed by SIGKILL (signal 9)"
    assert _exception_line(killed) == "trainer rank 0 was killed by SIGKILL (signal 9)"
    assert _exception_line("ValueError: taskset x has no valid rows\n  line 2: bad") == \
        "ValueError: taskset x has no valid rows"


def test_the_first_failure_is_reported_not_its_consequences(tmp_path):
    now = time.time()
    # rank 1 was killed first; rank 0 then lost its peer in a collective
    _result(tmp_path, "77", 0, "RuntimeError: Connection closed by peer", now)
    _result(tmp_path, "77", 1, "rft.runtime.supervisor.RankKilledError: rollout rank 1 was killed by SIGKILL", now - 5)
    failure = find_failure(str(tmp_path), str(tmp_path), "77", 2, alive=lambda rank: True)
    assert failure == RankFailure(1, os.path.join(tmp_path, "77_1_log.err"), "rollout rank 1 was killed by SIGKILL")


def test_a_vanished_rank_without_a_result_is_reported(tmp_path):
    failure = find_failure(str(tmp_path), str(tmp_path), "78", 2, alive=lambda rank: rank != 1)
    assert failure is not None and failure.rank == 1 and "exited without a result" in failure.reason
    assert find_failure(str(tmp_path), str(tmp_path), "78", 2, alive=lambda rank: True) is None


def _pulse(run_dir, rank, seconds_ago):
    from rft.runtime.pulse import pid_path

    path = pid_path(str(run_dir), rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("1")
    at = time.time() - seconds_ago
    os.utime(path, (at, at))


def test_a_rank_silent_while_its_peers_beat_is_named_as_stopped(tmp_path):
    from rft.launch.failures import silent_rank, stopped_responding

    logs = tmp_path / "logs"
    logs.mkdir()
    for rank, ago in ((0, 1), (1, 90), (2, 2)):  # rank 1 stopped 90 s ago; the others beat
        _pulse(tmp_path, rank, ago)
    alive = lambda rank: True  # noqa: E731  (a stopped process lives)
    assert silent_rank(str(tmp_path), str(logs), "5", 3, alive, 60) == (1, pytest.approx(90, abs=2))
    assert silent_rank(str(tmp_path), str(logs), "5", 3, alive, 120) is None  # not silent that long yet
    assert silent_rank(str(tmp_path), str(logs), "5", 3, alive, 60, besides={1}) is None
    assert silent_rank(str(tmp_path), str(logs), "5", 3, alive, 60, among={0, 2}) is None  # only these watched
    assert silent_rank(str(tmp_path), str(logs), "5", 3, lambda rank: rank != 1, 60) is None  # it ended: not stopped
    _result(logs, "5", 1, "ValueError: x", time.time())
    assert silent_rank(str(tmp_path), str(logs), "5", 3, alive, 60) is None  # it reported: not stopped
    for rank in (0, 2):
        _pulse(tmp_path, rank, 300)  # nobody beats (a requeued job waiting in the queue): nobody is blamed
    assert silent_rank(str(tmp_path), str(logs), "6", 3, alive, 60) is None

    then = RankFailure(2, "x.err", "TimeoutError: rollout rank 2: trainer rank 0 did not reach 'a' within 60s")
    said = stopped_responding(1, 90.0, str(logs), "5", lambda rank: f"trainer rank {rank}", then)
    assert said.rank == 1 and said.log_path == os.path.join(logs, "5_1_log.err")
    assert said.reason.startswith("trainer rank 1 stopped responding: no heartbeat for 90 s")
    assert said.reason.endswith("rank 2 then failed: " + then.reason)


def test_a_slurm_rank_that_wrote_no_log_points_at_an_unshared_run_dir(tmp_path, monkeypatch):
    """A Slurm job whose nodes do not see run.output_dir cannot even open its log there: a rank
    gone without a result and without a log names that as the likely cause; one with a log does not."""
    from rft.launch import failures

    monkeypatch.setattr(failures, "slurm_job_state", lambda job_id: "FAILED, exit code 1:0")
    failure = find_failure(str(tmp_path), str(tmp_path), "79", 1, alive=lambda rank: False, on_slurm=True)
    assert failure is not None and "Slurm: job 79 FAILED, exit code 1:0; it wrote no log into" in failure.reason
    assert f"run.output_dir ({tmp_path})" in failure.reason and "not on a node-local path such as /tmp" in failure.reason
    (tmp_path / "79_0_log.out").write_text("submitit INFO - Starting\n")
    failure = find_failure(str(tmp_path), str(tmp_path), "79", 1, alive=lambda rank: False, on_slurm=True)
    assert failure is not None and "wrote no log" not in failure.reason


def test_after_a_cancel_the_launcher_waits_for_the_ranks_saving_and_no_longer(tmp_path, monkeypatch):
    """A cancelled Slurm job's ranks save on its SIGTERM: the launcher returns once each has written
    its result (a launch again then resumes from that save), and no later than the bound (KillWait)
    when one never does. No squeue on PATH: the queue says nothing either way."""
    import threading

    from rft.launch.job_state import wait_for_saving_ranks

    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    now = time.time()
    _result(tmp_path, "79", 0, "StoppedBySignal: stopped on SIGTERM", now)
    later = threading.Timer(0.5, _result, (tmp_path, "79", 2, "StoppedBySignal: stopped on SIGTERM", now))
    later.start()
    started = time.monotonic()
    assert wait_for_saving_ranks("79", str(tmp_path), [0, 2], timeout_s=20)
    assert 0.4 < time.monotonic() - started < 10  # waited for rank 2's save, not for the bound
    started = time.monotonic()
    assert not wait_for_saving_ranks("79", str(tmp_path), [0, 1, 2], timeout_s=1.5)  # rank 1 never writes
    assert 1.5 <= time.monotonic() - started < 5
