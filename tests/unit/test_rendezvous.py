"""The rendezvous checks a rank runs before it joins rank 0's store: an address that does not
resolve or does not answer is reported naming the address and the settings to change."""

import socket
import time

import pytest

from rft.runtime.rendezvous import RendezvousError, interface_towards, rendezvous_address, wait_until_reachable


def test_an_address_that_does_not_answer_is_reported_after_the_budget():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port} \\(node node1\\) did not answer") as err:
        wait_until_reachable("127.0.0.1", port, "node1", budget_s=2)
    # the whole 2 s budget, then the report: 2.01 s measured (2 cores under load), the bound 5 x that
    assert 2 <= time.monotonic() - started < 10
    assert "cluster.rendezvous_addr" in str(err.value) and "GLOO_SOCKET_IFNAME" in str(err.value)


def test_a_listening_store_is_found_at_once():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        wait_until_reachable("127.0.0.1", server.getsockname()[1], "node1", budget_s=2)


def test_a_name_that_does_not_resolve_names_the_setting(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    with pytest.raises(RendezvousError, match="'no-such-node.invalid' does not resolve on node node2"):
        rendezvous_address("node1", "no-such-node.invalid")


def test_the_loopback_is_refused_only_for_a_rank_0_on_another_node(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    assert rendezvous_address("node1", "localhost") == "127.0.0.1"  # one node: loopback is right
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    with pytest.raises(RendezvousError, match="its own loopback, but rank 0 runs on node node1"):
        rendezvous_address("node1", "localhost")


def test_gloo_binds_the_interface_that_reaches_the_address():
    assert interface_towards("127.0.0.1") == "lo"


def test_a_run_dir_another_node_does_not_see_is_named_with_the_fix(tmp_path, monkeypatch):
    """check_run_dir_shared through a real TCPStore: rank 0 writes into its run directory; a rank
    that sees the same directory passes, one whose path is another directory (a node-local /tmp)
    fails naming both nodes, the path and what to use instead."""
    from rft.runtime.rendezvous import RunDirNotShared, check_run_dir_shared
    from tests.unit.test_dealer import _stores

    shared, local = tmp_path / "shared", tmp_path / "local"
    for run_dir in (shared, local):
        (run_dir / "pids").mkdir(parents=True)
    stores = _stores(2)
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    check_run_dir_shared(stores[0], 0, str(shared))
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    check_run_dir_shared(stores[1], 1, str(shared), wait_s=1)  # the same filesystem
    with pytest.raises(RunDirNotShared) as err:
        check_run_dir_shared(stores[1], 1, str(local), wait_s=1)
    said = str(err.value)
    assert said.startswith(f"run.output_dir={local} is not shared: rank 0 wrote {shared}/pids/shared-")  # (its path)
    assert "on node node1, and node node2 (rank 1) does not see it after 1 s" in said and "node-local paths" in said
    while stores:
        stores.pop()
