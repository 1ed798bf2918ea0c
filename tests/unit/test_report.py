"""What the launcher says about a failed job: the rank that failed first (not the peers that
failed after it), its exception without module paths, a killed rank as the supervisor's message."""

import os
import pickle
import time

from rft.report import RankFailure, _exception_line, find_failure


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
