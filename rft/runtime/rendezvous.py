"""Where a Slurm job's ranks meet across nodes: rank 0's address as the other nodes reach it, the
network interface gloo binds, and a check that fails fast when the meeting point is unreachable.

- **The address.** A node's name does not always resolve on the other nodes, and where it does
  it may name a management network. Slurm's own `NodeAddr` for the first node (how slurmctld
  reaches it, `scontrol show node`) is the address the job already depends on; it is resolved
  on each rank. `cluster.rendezvous_addr` overrides it (another network, a name that resolves).
- **The interface.** torch's gloo binds the interface named by `GLOO_SOCKET_IFNAME`, and without
  it the address its host name resolves to: 127.0.1.1 on Debian-style nodes, which it then
  advertises to the other nodes ("connection refused, remote=[127.0.0.1]"). Unset, it is set to
  the interface this node reaches the rendezvous address through. NCCL picks its own (honouring
  `NCCL_SOCKET_IFNAME`). Set either with `cluster.env`.
- **Failing fast.** Every rank but 0 checks that rank 0's control store answers before it
  joins: an address that does not resolve, or that is this node's loopback while rank 0 runs on
  another node, fails at once; one that does not answer fails after `REACH_BUDGET_S`, naming the
  address, the nodes and the settings to change, instead of waiting out sync.timeout_s.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import time

REACH_BUDGET_S = 45.0  # rank 0 hosts the store within seconds of starting: imports, no model yet
SETTINGS = "set cluster.rendezvous_addr to an address of the first node the others reach, or pick the " \
           "network with +cluster.env.GLOO_SOCKET_IFNAME=<interface>"


class RendezvousError(RuntimeError):
    """Rank 0's meeting point cannot be found or reached from this rank."""


def slurm_node_addr(node: str) -> str:
    """Slurm's NodeAddr of `node` (its name when Slurm knows no other, or scontrol fails)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return node
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("NodeAddr") or node


def resolve(host: str, where: str) -> str:
    """`host`'s IPv4 address (or itself if it is one); RendezvousError naming `where` otherwise."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as err:
        raise RendezvousError(f"{where}: {host!r} does not resolve on node {this_node()} ({err.strerror}); "
                              f"{SETTINGS}") from None


def this_node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def rendezvous_address(first_node: str, override: str | None) -> str:
    """The address this rank reaches rank 0 (on `first_node`) at."""
    host = override or slurm_node_addr(first_node)
    where = "cluster.rendezvous_addr" if override else f"the rendezvous (node {first_node}, Slurm NodeAddr)"
    address = resolve(host, where)
    if ipaddress.ip_address(address).is_loopback and this_node() != first_node:
        raise RendezvousError(f"{where}: {host!r} is {address} on node {this_node()}, its own loopback, but rank 0 "
                              f"runs on node {first_node}; {SETTINGS}")
    return address


def interface_towards(address: str) -> str | None:
    """The network interface this node sends to `address` through (None if none is found)."""
    import psutil  # vLLM's dependency too

    local = host_address(address)  # no packet leaves: the kernel only picks the route
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    return None


def host_address(towards: str) -> str:
    """This node's address on the route to `towards` (what its peers reach it at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((towards, 9))
        except OSError:
            return "?"
        return probe.getsockname()[0]


def bind_gloo_towards(address: str) -> None:
    """GLOO_SOCKET_IFNAME, unless the user set it: the interface towards the rendezvous."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = interface_towards(address)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def wait_until_reachable(address: str, port: int, first_node: str, budget_s: float = REACH_BUDGET_S) -> None:
    """Return once something listens at address:port (rank 0's store); RendezvousError after `budget_s`."""
    deadline, last = time.monotonic() + budget_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, budget_s)):
                return
        except OSError as err:
            last = err
            time.sleep(1.0)
    raise RendezvousError(f"rank 0's control store at {address}:{port} (node {first_node}) did not answer node "
                          f"{this_node()} within {budget_s:.0f} s ({last}); {SETTINGS}")


SHARED_KEY = "rft-shared-run-dir"
SHARED_WAIT_S = 30.0  # NFS may show a file created on another node only after its attribute cache expires


class RunDirNotShared(RuntimeError):
    """This rank does not see the run directory rank 0 writes to."""


def check_run_dir_shared(store, rank: int, run_dir: str, wait_s: float = SHARED_WAIT_S) -> None:
    """Every voting rank, once the job's store is up: rank 0 writes a file of its own into the run
    directory and posts its name; each other rank must see that file. A run directory on a
    node-local path (/tmp, $TMPDIR, a local scratch disk) would otherwise fail later and far from
    the cause: the trainer waiting for experience shards that another node wrote to its own disk."""
    import json
    import uuid

    if rank == 0:  # (run_dir is the same string on every rank: one config)
        path = os.path.join(run_dir, "pids", f"shared-{uuid.uuid4().hex[:12]}")
        with open(path, "w") as f:
            f.write(this_node())
        store.set(SHARED_KEY, json.dumps({"path": path, "node": this_node()}))
        return
    posted = json.loads(store.get(SHARED_KEY))
    mine = os.path.join(run_dir, "pids", os.path.basename(posted["path"]))  # the same path, as this node sees it
    deadline = time.monotonic() + wait_s
    while not os.path.exists(mine):
        if time.monotonic() > deadline:
            raise RunDirNotShared(
                f"run.output_dir={run_dir} is not shared: rank 0 wrote {posted['path']} on node {posted['node']}, "
                f"and node {this_node()} (rank {rank}) does not see it after {wait_s:.0f} s. Every node of the job "
                "must see run.output_dir on one filesystem (Lustre, GPFS, NFS: your project or scratch space); "
                "node-local paths (/tmp, $TMPDIR, a local disk) are not")
        time.sleep(0.5)
