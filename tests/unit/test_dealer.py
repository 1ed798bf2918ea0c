"""Dealing tasks to several engines through a real TCPStore (rft/explorer/dealer.py): every task
exactly once, a slow engine dealt fewer, meeting points that name an engine that never came, and
a lost engine's tasks dealt again to the others (rollout.on_engine_failure=continue)."""

import asyncio
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from rft.explorer.dealer import Deal, Dealer
from rft.runtime.membership import MemberLostError, mark_lost
from rft.runtime.topology import free_port


def _stores(n: int, timeout_s: float = 10.0) -> list[dist.Store]:
    port = free_port()
    timeout = datetime.timedelta(seconds=timeout_s)
    host = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timeout, wait_for_workers=False)
    return [host] + [dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
                     for _ in range(n - 1)]


def _take(dealer: Dealer, batch: str, tasks: int, seconds_per_task: float, taken: list[int], deal=None) -> None:
    """An engine's runner in small: `window` workers pull task indices until none is left."""
    deal = deal or dealer.deal(batch, tasks)

    async def worker():
        while (i := deal.claim()) < tasks:
            await asyncio.sleep(seconds_per_task)
            taken.append(i)

    async def engine():
        await asyncio.gather(*(worker() for _ in range(deal.window)))

    asyncio.run(engine())


def test_every_task_is_dealt_once_and_a_slow_engine_gets_fewer():
    """The slow engine takes its first window before the fast one starts: otherwise, on a loaded
    machine, its thread started after the fast engine had taken every task (seen in CI: 0 of 64)."""
    stores = _stores(2)
    fast, slow = [], []
    slow_deal = Dealer(stores[1], 1, 2, 10.0).deal("7:0", 64)
    window_taken = threading.Event()
    claims = iter(range(slow_deal.window))

    def claim_then_say() -> int:  # the slow engine's claim, saying when its whole first window is taken
        i = slow_deal.claim()
        if next(claims, None) == slow_deal.window - 1:
            window_taken.set()
        return i

    def fast_engine() -> None:
        window_taken.wait(10)
        _take(Dealer(stores[0], 0, 2, 10.0), "7:0", 64, 0.005, fast)

    told = Deal(claim=claim_then_say, window=slow_deal.window)
    engines = [threading.Thread(target=fast_engine),
               threading.Thread(target=_take, args=(None, "7:0", 64, 0.05, slow, told))]
    for t in engines:
        t.start()
    for t in engines:
        t.join()
    assert sorted(fast + slow) == list(range(64))  # each task once, none lost
    assert Dealer(stores[0], 0, 2, 10.0).deal("7:0", 64).window == 16  # half of an even share at once
    assert len(slow) < len(fast), (len(slow), len(fast))  # by load, not 32 each
    assert len(slow) >= 16  # its first window


def test_one_engine_takes_every_task_without_the_store():
    dealer = Dealer(store=None, index=0, count=1, timeout_s=1.0)
    deal = dealer.deal("x", 5)
    assert [deal.claim() for _ in range(6)] == [0, 1, 2, 3, 4, 5] and deal.window == 5
    assert dealer.gather("k", {"a": 1}) == {0: {"a": 1}} and dealer.total("k", 3) == 3


def test_gather_returns_every_engines_payload_in_engine_order():
    stores = _stores(3)
    results = [None] * 3

    def engine(e):
        dealer = Dealer(stores[e], e, 3, 10.0)
        results[e] = (dealer.gather("eval-0", {"engine": e, "rewards": [e] * e}), dealer.total("kept:1:0", e + 1))

    threads = [threading.Thread(target=engine, args=(e,)) for e in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = {e: {"engine": e, "rewards": [e] * e} for e in range(3)}
    assert all(r == (expected, 6) for r in results), results
    assert not stores[0].check(["rft-deal/eval-0/0"])  # the last reader freed the keys


def test_an_engine_that_never_reports_is_named():
    stores = _stores(2, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rollout engine 1 \(rank 1\) did not reach 'rft-deal/kept:3:0' within 1s"):
        Dealer(stores[0], 0, 2, 1.0).total("kept:3:0", 4)
    assert time.monotonic() - start < 5  # the 1 s timeout: 1.03 s measured (2 cores under load), the bound 5 x that


def _survivor(dealer: Dealer, taken: list[int], rounds: list[int]) -> None:
    """An engine that runs its share of a batch, then the tasks a lost engine took with it."""
    _take(dealer, "9:0", 64, 0.01, taken)
    again = 0
    while (deal := dealer.redeal(f"9:0/again{again}", 64, list(taken))) is not None:
        _take(dealer, "9:0", 64, 0.01, taken, deal)
        again += 1
    rounds.append(again)


def test_a_lost_engines_tasks_are_dealt_again_to_the_engines_left():
    stores = _stores(3)
    lost_dealer = Dealer(stores[2], 2, 3, 10.0, tolerated=frozenset({2}))
    held = [lost_dealer.deal("9:0", 64).claim() for _ in range(5)]  # taken, then the engine dies
    mark_lost(stores[2], 2, "killed by SIGKILL")  # what its supervising task process writes
    taken, rounds = [[], []], []
    threads = [threading.Thread(target=_survivor, args=(Dealer(stores[e], e, 3, 10.0, tolerated=frozenset({2})),
                                                         taken[e], rounds)) for e in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken[0] + taken[1]) == list(range(64))  # every task ran once on the engines left
    assert held == [0, 1, 2, 3, 4] and rounds == [1, 1]  # the lost engine's five, dealt again once


def test_a_lost_engine_ends_the_meeting_at_once_when_the_run_fails_fast():
    stores = _stores(2)
    mark_lost(stores[1], 1, "killed by SIGKILL")
    start = time.monotonic()
    with pytest.raises(MemberLostError, match=r"rollout engine 1 \(rank 1\) failed: killed by SIGKILL"):
        Dealer(stores[0], 0, 2, 60.0).total("kept:4:0", 1)  # not tolerated: the default policy
    assert time.monotonic() - start < 5  # the mark, not the 60 s timeout: 0.01 s measured (2 cores under load)
