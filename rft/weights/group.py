"""A weight-transfer process group that lives beside torch.distributed's default group.

The trainer's sender and every rollout worker join it. It is built directly from a `TCPStore`
and `ProcessGroupGloo` so it never touches the global default group: vLLM's workers own their
own default group, Megatron's trainer ranks own theirs. Collectives are called on the group
object itself with group-local ranks and wait with a timeout, so a dead or stalled peer raises
an error naming the peer instead of hanging.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerTimeoutError(RuntimeError):
    """A collective on the weight group did not finish in time (a peer died or stalled)."""


@dataclass
class WeightGroup:
    """Group-local rank 0 sends; everyone else receives."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    timeout_s: float
    peer_names: list[str]
    store: dist.Store  # the rendezvous store must outlive the group

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Broadcast `tensor` in place from group rank 0; `what` names the payload in errors."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        work = self.pg.broadcast([tensor], opts)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:
            others = [n for i, n in enumerate(self.peer_names) if i != self.rank]
            raise PeerTimeoutError(
                f"weight transfer of {what} failed after at most {self.timeout_s:.0f}s "
                f"(group rank {self.rank}; peers {', '.join(others)}): {err}"
            ) from err


def open_weight_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                      peer_names: list[str]) -> WeightGroup:
    """Join (rank 0: host) the weight group. Every member calls this with the same host/port.

    `peer_names[i]` describes group rank i (e.g. "trainer rank 0", "rollout rank 1") so errors
    name the peer in terms the user knows.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=True)
    prefixed = dist.PrefixStore("rft-weights", store)
    pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightGroup(pg=pg, rank=rank, world_size=world_size, timeout_s=timeout_s,
                       peer_names=peer_names, store=store)
