"""Weight-transfer process groups that live beside torch.distributed's default group.

Each group joins one trainer sender (one per pipeline stage) with every rollout worker. Groups are
built directly from a `TCPStore` (hosted by trainer rank 0, one port for all groups, a prefix per
group) and `ProcessGroupGloo` / `ProcessGroupNCCL`, so they never touch the global default group:
vLLM's workers own theirs, Megatron's trainer ranks own theirs. Every member creates its groups in
the same order (stage 0, 1, ...). Collectives are called on the group object with group-local ranks
and wait with a timeout, so a dead or stalled peer raises an error naming the peers and the payload
in flight instead of hanging.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerTimeoutError(RuntimeError):
    """A collective on a weight group did not finish in time (a peer died or stalled)."""


def open_store(host: str, port: int, is_host: bool, timeout_s: float) -> dist.Store:
    """The rendezvous store every weight group shares; trainer rank 0 hosts it."""
    return dist.TCPStore(host, port, None, is_master=is_host,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


@dataclass
class Pending:
    """An in-flight broadcast; `wait()` raises `PeerTimeoutError` naming peers and payload."""

    work: dist.Work
    group: "WeightGroup"
    what: str

    def wait(self) -> None:
        g = self.group
        try:
            # with an explicit timeout, gloo and NCCL work objects both block this thread until the
            # collective completes or the timeout passes, then raise
            self.work.wait(datetime.timedelta(seconds=g.timeout_s))
        except Exception as err:
            others = [n for i, n in enumerate(g.peer_names) if i != g.rank]
            raise PeerTimeoutError(
                f"weight transfer of {self.what} failed after at most {g.timeout_s:.0f}s "
                f"(this is {g.peer_names[g.rank]}; peers: {', '.join(others)}): {err}"
            ) from err


@dataclass
class WeightGroup:
    """Group-local rank 0 sends; everyone else receives. `device` is where payloads must live."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    timeout_s: float
    peer_names: list[str]
    device: torch.device
    store: dist.Store  # the rendezvous store must outlive the group

    def broadcast_async(self, tensor: torch.Tensor, what: str) -> Pending:
        """Start broadcasting `tensor` in place from group rank 0; `what` names it in errors."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return Pending(self.pg.broadcast([tensor], opts), self, what)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.broadcast_async(tensor, what).wait()


def wait_for_members(store: dist.Store, name: str, rank: int, world_size: int, timeout_s: float,
                     peer_names: list[str]) -> None:
    """Check in at group `name` and wait at most `timeout_s` for every member to do the same;
    PeerTimeoutError names the members that did not come."""
    arrived = [f"arrived/{member}" for member in range(world_size)]
    store.set(arrived[rank], b"1")
    try:
        store.wait(arrived, datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # torch's DistStoreError (a timeout) or a store that went away
        missing = [peer_names[m] for m, key in enumerate(arrived) if not _has(store, key)]
        raise PeerTimeoutError(f"weight group {name}: {', '.join(missing) or 'a member'} did not come to open it "
                               f"within {timeout_s:.0f}s (this is {peer_names[rank]}): {err}") from err


def _has(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # the store itself is gone
        return False


def open_weight_group(store: dist.Store, name: str, rank: int, world_size: int, timeout_s: float,
                      peer_names: list[str], backend: str = "gloo", open_timeout_s: float | None = None) -> WeightGroup:
    """Join weight group `name` as group rank `rank` (0 = the sender). Blocks until all joined, at
    most `open_timeout_s` (default `timeout_s`; PeerTimeoutError naming who did not come): members
    may still be starting, which takes longer than a collective; `timeout_s` bounds the group's
    collectives. An NCCL group's communicator is built here, not in the first broadcast.

    `peer_names[i]` describes group rank i (e.g. "trainer rank 0 (PP stage 0)", "rollout rank 1
    worker 0") so errors name the peer in terms the user knows. `backend` is "gloo" (CPU tensors)
    or "nccl" (tensors on this process's current CUDA device).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"rft-weights/{name}", store)
    wait_for_members(prefixed, name, rank, world_size, timeout_s if open_timeout_s is None else open_timeout_s,
                     peer_names)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        device = torch.device("cuda", torch.cuda.current_device())
        # NCCL builds its communicator at the first collective unless asked now (torch's
        # init_process_group does the same when given a device_id: distributed_c10d.py). Now, every
        # member is known to be here; inside the first broadcast the build waits for members with no
        # timeout of its own, and a receiver that never came hung the sender, trainer rank 0
        pg.eager_connect_single_device(device)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        device = torch.device("cpu")
    else:
        raise ValueError(f"weight group backend {backend!r}: use 'gloo' or 'nccl'")
    return WeightGroup(pg=pg, rank=rank, world_size=world_size, timeout_s=timeout_s,
                       peer_names=peer_names, device=device, store=store)
