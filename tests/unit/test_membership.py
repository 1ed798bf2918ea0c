"""Meetings through a real TCPStore (rft/runtime/membership.py): many rounds back to back leave
no key behind and never stall on the store host's wait for readers (it once brought a deleted
read counter back and waited out the whole timeout), a lost tolerated member is left out, and a
lost member the run needs ends the meeting naming it."""

import threading

import pytest

from rft.runtime.membership import Meeting, MemberLostError, mark_lost
from tests.unit.test_dealer import _stores


def _meet(stores, rounds: int, timeout_s: float, results: dict, tolerated=frozenset()) -> None:
    def member(rank: int) -> None:
        meeting = Meeting(stores[rank], list(range(len(stores))), rank, timeout_s, lambda r: f"rank {r}", tolerated,
                          host=0)
        try:
            results[rank] = [meeting.post(f"vote/{i}", rank * 1000 + i) for i in range(rounds)]
        except Exception as error:  # the test asserts on it
            results[rank] = error

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_many_rounds_with_the_host_waiting_for_readers_leave_nothing_behind():
    stores = _stores(3, timeout_s=30.0)
    results: dict = {}
    _meet(stores, rounds=300, timeout_s=20.0, results=results)
    for rank in range(3):
        assert not isinstance(results[rank], Exception), results[rank]
        assert results[rank] == [{r: r * 1000 + i for r in range(3)} for i in range(300)]
    assert stores[0].num_keys() <= 1  # torch's own init key at most: every vote and counter freed
    while stores:  # clients before their host: a host freed first stalls the clients' teardown
        stores.pop()


def test_a_lost_tolerated_member_is_left_out_and_a_needed_one_is_named():
    stores = _stores(3)
    mark_lost(stores[0], 2, "killed by signal 9")
    results: dict = {}
    _meet(stores[:2], rounds=1, timeout_s=5.0, results=results)  # a meeting of 0 and 1 only: rank 2 not asked
    meeting = Meeting(stores[1], [0, 1, 2], 1, 5.0, lambda r: f"engine rank {r}", frozenset({2}), host=0)
    other = threading.Thread(target=lambda: Meeting(stores[0], [0, 1, 2], 0, 5.0, str, frozenset({2}), host=0)
                             .post("k", "zero"))
    other.start()
    assert meeting.post("k", "one") == {0: "zero", 1: "one"} and meeting.present == [0, 1]
    other.join()
    with pytest.raises(MemberLostError, match="engine rank 2 failed: killed by signal 9"):
        Meeting(stores[1], [1, 2], 1, 5.0, lambda r: f"engine rank {r}").post("j", "one")


def test_rank_0_marks_lost_the_engines_whose_pulse_stopped_or_who_lost_the_network(tmp_path, monkeypatch):
    """PulseWatch: an engine whose node crashed (no pulse for 60 s) and one cut off from rank 0
    (its `.cut` record says 30 s) are marked lost in the store, with how; a beating engine is not;
    nothing is marked once stopped (ranks that finish stop beating too)."""
    import json
    import os
    import time

    from rft.runtime import pulse
    from rft.runtime.membership import PulseWatch, lost_ranks
    from rft.runtime.pulse import pid_path

    for rank, ago in ((1, 1), (2, 60), (3, 1), (4, 60)):
        path = pid_path(str(tmp_path), rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
        os.utime(path, (time.time() - ago, time.time() - ago))
    with open(pulse.cut_path(pid_path(str(tmp_path), 3)), "w") as f:
        json.dump({"address": "10.0.0.1:20001", "for_s": 30.0, "error": "timed out"}, f)
    monkeypatch.setattr(pulse, "PULSE_S", 0.05)
    stores = _stores(2)
    before = set(threading.enumerate())
    watch = PulseWatch(stores[1], str(tmp_path), frozenset({1, 2, 3}), lambda r: f"rollout rank {r}")
    (watching,) = [t for t in threading.enumerate() if t.name == "rft-pulse-watch" and t not in before]
    deadline = time.monotonic() + 10
    while len(lost_ranks(stores[0], [1, 2, 3, 4])) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop()
    lost = lost_ranks(stores[0], [1, 2, 3, 4])
    assert sorted(lost) == [2, 3]  # 4 is silent but not watched (not an engine the run may lose)
    assert lost[2].startswith("rollout rank 2 stopped responding: no heartbeat for 6")
    assert lost[3] == "rollout rank 3 lost the network to rank 0: its control store at 10.0.0.1:20001 has not " \
                      "answered it for 30 s"
    os.utime(pid_path(str(tmp_path), 1), (time.time() - 60, time.time() - 60))
    watching.join(timeout=60)  # its last look, if one was under way, then it ends: no sleep to guess that
    assert not watching.is_alive()
    assert sorted(lost_ranks(stores[0], [1, 2, 3])) == [2, 3]  # stopped: rank 1 going quiet is not a loss
    while stores:
        stores.pop()
