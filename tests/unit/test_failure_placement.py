"""What the launcher adds to a failed rank of a Slurm job: its node and address as the rank
logged them, the ranks on each node, and the last lines of its logs."""

from rft.launch.failures import RankFailure, last_lines, where_it_ran


def _logs(tmp_path, placed: dict[int, tuple[str, str]], err_lines: int = 0) -> None:
    for rank, (node, address) in placed.items():
        (tmp_path / f"7_{rank}_log.out").write_text(
            f"submitit INFO - Starting\nrank {rank}/{len(placed)}: trainer (role rank {rank}) on {node} ({address}), "
            f"rank 0 at 10.0.0.1:20021\n")
        (tmp_path / f"7_{rank}_log.err").write_text("".join(f"err {i}\n" for i in range(err_lines)))


def test_a_failed_rank_is_placed_on_its_node_beside_the_other_nodes_ranks(tmp_path):
    _logs(tmp_path, {0: ("n1", "10.0.0.1"), 1: ("n1", "10.0.0.1"), 2: ("n2", "10.0.0.2")}, err_lines=8)
    lines = where_it_ran(RankFailure(2, "", "timed out"), str(tmp_path), "7", 3)
    assert lines[0] == "on node n2 (10.0.0.2), which ran rank(s) 2"
    assert lines[1] == "the job's nodes: n1 (10.0.0.1): rank(s) 0, 1; n2 (10.0.0.2): rank(s) 2"
    assert lines[2] == "last lines of its log.out:" and lines[4].startswith("  rank 2/3: trainer")
    assert lines[5:] == ["last lines of its log.err:"] + [f"  err {i}" for i in range(3, 8)]  # the last 5


def test_one_node_and_a_rank_that_never_logged(tmp_path):
    _logs(tmp_path, {0: ("n1", "10.0.0.1"), 1: ("n1", "10.0.0.1")})
    assert where_it_ran(RankFailure(0, "", "x"), str(tmp_path), "7", 2)[:2] == [
        "on node n1 (10.0.0.1), which ran rank(s) 0, 1", "last lines of its log.out:"]
    assert where_it_ran(RankFailure(5, "", "x"), str(tmp_path), "7", 6) == []  # no log of its own: nothing to add
    assert last_lines(str(tmp_path / "missing.log")) == []


def test_a_requeued_rank_is_placed_where_it_started_last(tmp_path):
    _logs(tmp_path, {0: ("n1", "10.0.0.1"), 1: ("n2", "10.0.0.2")})
    with open(tmp_path / "7_1_log.out", "a") as f:  # the requeued attempt, appended on another node
        f.write("rank 1/2: rollout (role rank 0) on n3 (10.0.0.3), rank 0 at 10.0.0.1:20021\n")
    assert where_it_ran(RankFailure(1, "", "x"), str(tmp_path), "7", 2)[0] == "on node n3 (10.0.0.3), which ran rank(s) 1"


def test_a_rank_that_loses_the_network_to_rank_0_is_named_a_refused_connection_is_not(tmp_path, monkeypatch):
    """The pulse's reach check (rft/runtime/pulse.py): no answer from rank 0's store writes the
    rank's `.cut` record, which the launcher reads as a partition; a refused connection (rank 0's
    node answered, rank 0 ended) clears it. The timeout a cut link gives is made here by a stand-in
    connect (a real cut link is tests/slurm/test_multinode.py's)."""
    import socket
    import time

    from rft.launch.failures import cut_off_from_rank0, cut_off_rank
    from rft.runtime.pulse import _check_reach, cut_path, pid_path

    pid = pid_path(str(tmp_path), 1)
    (tmp_path / "pids").mkdir()
    open(pid, "w").close()
    started = time.monotonic() - 30  # rank 0 last answered 30 s ago

    def no_answer(address, timeout):
        raise TimeoutError("timed out")

    with monkeypatch.context() as patched:
        patched.setattr(socket, "create_connection", no_answer)
        assert _check_reach(pid, ("192.0.2.1", 9), started) == started
    found = cut_off_rank(str(tmp_path), 2, 25)
    assert found is not None and found[0] == 1 and found[1]["address"] == "192.0.2.1:9" and found[1]["for_s"] >= 30
    assert cut_off_rank(str(tmp_path), 2, 60) is None  # not for that long yet
    assert cut_off_rank(str(tmp_path), 2, 25, besides={1}) is None  # an engine the run may lose
    failure = cut_off_from_rank0(*found, str(tmp_path), "7", lambda rank: f"rollout rank {rank}",
                                 RankFailure(0, "", "TimeoutError: weight sync"))
    assert failure.rank == 1 and failure.reason.startswith("rollout rank 1 lost the network to rank 0: its control "
                                                           "store at 192.0.2.1:9 has not answered it for 3")
    assert failure.reason.endswith("; rank 0 then failed: TimeoutError: weight sync")

    with socket.socket() as closed:  # a port nobody listens on: refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert _check_reach(pid, ("127.0.0.1", port), started) > started
    assert not (tmp_path / "pids" / "rank1.pid.cut").exists() and cut_off_rank(str(tmp_path), 2, 0) is None
    assert cut_path(pid).endswith("rank1.pid.cut")
