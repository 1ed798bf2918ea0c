"""Weight-transfer engines behind one interface: a sender per pipeline stage, a receiver per
rollout worker.

    sender.send(table, tensors, version) -> bytes      (trainer: one sender per PP stage)
    receiver.receive(load_fn, version) -> (version, tail_s)   (rollout: every vLLM worker; version:
                                                              the one expected, where known)

  gloo        broadcast over a ProcessGroupGloo per stage (CPU; same protocol as nccl)
  nccl        broadcast over a ProcessGroupNCCL per stage, built from the same store: a stateless
              NCCL group joining the stage's sender and every rollout worker (GPU)
  checkpoint  each stage writes its tensors as safetensors files of a consolidated HF checkpoint on
              the shared filesystem; receivers wait for it and load it (jobs in different
              allocations)

Why not vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`): its NCCL engine
needs a GPU to run at all, so nothing here could test the path CPU runs take. One broadcast
protocol for gloo and nccl keeps a single, tested code path, with multi-sender pipeline stages
and timeouts that name the peer. Groups open lazily at the first sync (training overlaps vLLM
start-up), every member in the same order: stage 0, 1, ...
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from rft.config import RFTConfig, sync_engine
from rft.runtime.monitor import write_json_atomic
from rft.runtime.topology import Topology
from rft.weights.hf_dir import INDEX, copy_model_files
from rft.weights.group import PeerTimeoutError, WeightGroup, open_store, open_weight_group
from rft.weights.transfer import (
    LoadFn,
    TensorTable,
    describe_bucket,
    dtype_from_name,
    plan_buckets,
    receive_weights,
    send_weights,
)

ENGINES = ("gloo", "nccl", "checkpoint")
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() would give a new file: a model a project's members can read


@dataclass(frozen=True)
class SyncLayout:
    """Who takes part in a weight sync; built identically on every rank from the config.

    Plain fields only: it crosses vLLM's RPC (msgpack) to the rollout workers as a dict.
    """

    engine: str
    host: str  # trainer rank 0 hosts the rendezvous store
    port: int
    sender_ranks: list[int]  # global trainer rank that sends each PP stage
    receiver_names: list[str]  # every rollout worker, in weight-group order
    timeout_s: float
    bucket_bytes: int
    checkpoint_dir: str
    groups: str = "stage"  # weight group s is named <groups><s>: a new name when the members change
    open_timeout_s: float | None = None  # how long opening a group waits for its members (None: timeout_s)

    @property
    def opening_s(self) -> float:
        return self.timeout_s if self.open_timeout_s is None else max(self.timeout_s, self.open_timeout_s)

    def peer_names(self, stage: int) -> list[str]:
        """Names of weight group `stage`'s members in group-rank order."""
        return [f"trainer rank {self.sender_ranks[stage]} (PP stage {stage})"] + self.receiver_names

    def as_dict(self) -> dict:
        return asdict(self)


def sync_layout(cfg: RFTConfig, topology: Topology, on_gpu: bool, engines: list[int] | None = None,
                restarts: int = 0) -> SyncLayout:
    """Weight-sync membership, identical on every rank. `engines`: the engine leaders that take
    part (default: all; rollout.on_engine_failure=continue leaves lost ones out, and the groups
    without them get their own names). `restarts`: the job's engine restarts so far
    (rollout.on_engine_failure=restart): each restart's groups get their own names too, as a new
    process stands in a restarted engine's place.

    Megatron orders ranks tp fastest, then dp, then pp, so stage s's first rank (TP rank 0 of
    DP replica 0) is s x trainer_ranks / pp; it sends that stage. Each rollout rank contributes
    one receiver per vLLM TP worker.
    """
    per_stage = topology.trainer_ranks // cfg.trainer.pipeline_parallel_size
    workers = cfg.rollout.tensor_parallel_size
    leaders = topology.engine_leaders
    engines = leaders if engines is None else engines
    receivers = [f"engine {e} (rollout rank {leader}) worker {w}"
                 for e, leader in enumerate(leaders) if leader in engines for w in range(workers)]
    lost = [str(leader) for leader in leaders if leader not in engines]
    return SyncLayout(
        engine=sync_engine(cfg.sync, on_gpu, cfg.cluster.colocate), host=topology.master_addr, port=topology.weight_port,
        sender_ranks=[s * per_stage for s in range(cfg.trainer.pipeline_parallel_size)],
        receiver_names=receivers, timeout_s=cfg.sync.timeout_s, open_timeout_s=cfg.sync.start_timeout_s,
        bucket_bytes=cfg.sync.bucket_mb << 20,
        checkpoint_dir=cfg.sync.checkpoint_dir or os.path.join(cfg.run.output_dir, "weights"),
        groups=(f"stage-without-{'-'.join(lost)}-" if lost else "stage") + (f"-restart{restarts}-" if restarts else ""))


class BroadcastSender:
    def __init__(self, layout: SyncLayout, stage: int):
        self.layout, self.stage = layout, stage
        self.group: WeightGroup | None = None
        self.store: dist.Store | None = None

    def reopen(self, layout: SyncLayout) -> None:
        """Send to `layout`'s members from the next sync on, in new groups (an engine was lost);
        the store stays: stage 0's sender hosts it on the weight port."""
        self.layout, self.group = layout, None

    def send(self, table: TensorTable, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        lay = self.layout
        if self.group is None:
            self.store = store = self.store or open_store(lay.host, lay.port, self.stage == 0, lay.opening_s)
            self.group = open_weight_group(store, f"{lay.groups}{self.stage}", 0, 1 + len(lay.receiver_names),
                                           lay.timeout_s, lay.peer_names(self.stage), lay.engine, lay.opening_s)
        return send_weights(self.group, table, tensors, version, lay.bucket_bytes)


class BroadcastReceiver:
    def __init__(self, layout: SyncLayout, index: int):
        self.layout, self.index = layout, index
        self.groups: list[WeightGroup] = []

    def receive(self, load_fn: LoadFn, version: int | None = None) -> tuple[int, float]:
        """The next sync the senders broadcast (it is the version they send: `version` is not needed)."""
        lay = self.layout
        if not self.groups:
            store = open_store(lay.host, lay.port, False, lay.opening_s)
            self.groups = [open_weight_group(store, f"{lay.groups}{s}", 1 + self.index, 1 + len(lay.receiver_names),
                                             lay.timeout_s, lay.peer_names(s), lay.engine, lay.opening_s)
                           for s in range(len(lay.sender_ranks))]
        versions, tail_s = set(), 0.0
        for group in self.groups:  # stage by stage, in the order every member uses
            version, tail_s = receive_weights(group, load_fn, lay.bucket_bytes)
            versions.add(version)
        if len(versions) != 1:
            raise RuntimeError(f"pipeline stages sent different weight versions {sorted(versions)}")
        return versions.pop(), tail_s


def version_dir(root: str, version: int) -> str:
    """Where the checkpoint engine writes weights version `version` (an HF checkpoint once complete)."""
    return os.path.join(root, f"v{version:06d}")


def newest_complete_version(root: str) -> int:
    """The newest version in `root` whose index file (written last) is there; 0 if none."""
    found = glob.glob(os.path.join(root, "v*", INDEX))
    return max((int(os.path.basename(os.path.dirname(p))[1:]) for p in found), default=0)


class CheckpointSender:
    """Writes version v as `<dir>/v<v>/`: safetensors files per bucket, one `stage<s>.json` per stage,
    and (once every stage is there) `model.safetensors.index.json`, which marks it complete."""

    def __init__(self, layout: SyncLayout, stage: int, hf_files_from: str | None = None,
                 keep_versions: int | None = 2):
        # 2: a receiver may still be reading the previous version; None: keep all (HF exports)
        self.layout, self.stage, self.hf_files_from = layout, stage, hf_files_from
        self.keep_versions = keep_versions
        self.sent_any = False

    def reopen(self, layout: SyncLayout) -> None:
        self.layout = layout  # readers find the files whoever they are

    def send(self, table: TensorTable, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        if not self.sent_any and self.keep_versions is not None:
            # a sync's versions after this one are a crashed attempt's: the resumed run writes them anew
            self._drop(lambda v: v > version)
        self.sent_any = True
        written = self.write(version_dir(self.layout.checkpoint_dir, version), table, tensors, version)
        if self.stage == 0 and self.keep_versions is not None:
            self._prune(version)
        return written

    def write(self, vdir: str, table: TensorTable, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """This stage's tensors into the HF directory `vdir`, complete (its index written) once
        every stage's are there. Returns the bytes written."""
        from safetensors.torch import save_file

        os.makedirs(vdir, exist_ok=True)
        source = iter(tensors)
        weight_map, written = {}, 0
        for k, indices in enumerate(plan_buckets(table, self.layout.bucket_bytes)):
            bucket = {}
            for i in indices:
                name, tensor = next(source)
                assert name == table[i][0], f"weight source yielded {name}, table announced {table[i][0]}"
                bucket[name] = tensor.detach().to("cpu", dtype_from_name(table[i][2])).contiguous()
            fname = f"stage{self.stage}-{k:05d}.safetensors"
            save_file(bucket, os.path.join(vdir, fname + ".tmp"), metadata={"format": "pt"})
            os.chmod(os.path.join(vdir, fname + ".tmp"), FILE_MODE)  # safetensors writes 0600: others could not read it
            os.replace(os.path.join(vdir, fname + ".tmp"), os.path.join(vdir, fname))
            weight_map.update({n: fname for n in bucket})
            written += sum(t.numel() * t.element_size() for t in bucket.values())
        if self.stage == 0 and self.hf_files_from:
            dtypes = {entry[2] for entry in table}  # "torch.bfloat16": what config.json should say the weights are
            copy_model_files(self.hf_files_from, vdir,
                             dtypes.pop().removeprefix("torch.") if len(dtypes) == 1 else None)
        write_json_atomic(os.path.join(vdir, f"stage{self.stage}.json"),
                           {"version": version, "table": table, "weight_map": weight_map})
        self._complete_if_last(vdir, version)
        return written

    def _complete_if_last(self, vdir: str, version: int) -> None:
        stages = [os.path.join(vdir, f"stage{s}.json") for s in range(len(self.layout.sender_ranks))]
        if not all(os.path.exists(p) for p in stages):
            return  # a later stage completes it; two stages that both see all files write the same
        weight_map = {}
        for path in stages:
            with open(path) as f:
                weight_map.update(json.load(f)["weight_map"])
        write_json_atomic(os.path.join(vdir, "model.safetensors.index.json"),
                           {"metadata": {"rft_version": version}, "weight_map": weight_map})

    def _prune(self, version: int) -> None:
        """Keep the newest `keep_versions` versions up to `version`: by count, not by number, since
        versions skip (sync.interval > 1, exports every save_interval steps)."""
        kept = sorted((v for v in self._versions() if v <= version), reverse=True)[:self.keep_versions]
        self._drop(lambda v: v < min(kept, default=version))

    def _versions(self) -> list[int]:
        return [int(os.path.basename(path)[1:]) for path in glob.glob(os.path.join(self.layout.checkpoint_dir, "v[0-9]*"))]

    def _drop(self, which) -> None:
        for version in self._versions():
            if which(version):
                shutil.rmtree(version_dir(self.layout.checkpoint_dir, version), ignore_errors=True)


class CheckpointReceiver:
    poll_s = 0.05

    def __init__(self, layout: SyncLayout, index: int):
        self.layout, self.index = layout, index
        self.version = 0

    def receive(self, load_fn: LoadFn, version: int | None = None) -> tuple[int, float]:
        """Load `version` once it is complete; without one, the newest newer than the one loaded.
        A run that resumes finds versions its previous attempt wrote after the checkpoint: only
        the one the trainer publishes now is right."""
        from safetensors import safe_open

        lay = self.layout
        deadline = time.monotonic() + lay.timeout_s

        def ready() -> int:
            if version is None:
                newest = newest_complete_version(lay.checkpoint_dir)
                return newest if newest > self.version else 0
            complete = os.path.exists(os.path.join(version_dir(lay.checkpoint_dir, version), INDEX))
            return version if complete else 0

        while not (found := ready()):
            if time.monotonic() > deadline:
                wanted = f"version {version}" if version is not None else f"no weights newer than version {self.version}"
                raise PeerTimeoutError(
                    f"{wanted} did not appear in {lay.checkpoint_dir} within {lay.timeout_s:.0f}s (writers: "
                    f"{', '.join(lay.peer_names(s)[0] for s in range(len(lay.sender_ranks)))})")
            time.sleep(self.poll_s)
        version = found
        vdir = version_dir(lay.checkpoint_dir, version)
        tail_start = time.perf_counter()
        for s in range(len(lay.sender_ranks)):
            with open(os.path.join(vdir, f"stage{s}.json")) as f:
                stage = json.load(f)
            table = [(n, tuple(shape), d) for n, shape, d in stage["table"]]
            plan = plan_buckets(table, lay.bucket_bytes)
            for k, indices in enumerate(plan):
                fname = stage["weight_map"][table[indices[0]][0]]
                try:
                    with safe_open(os.path.join(vdir, fname), framework="pt") as f:
                        load_fn([(table[i][0], f.get_tensor(table[i][0])) for i in indices])
                except FileNotFoundError as err:
                    raise RuntimeError(f"weights version {version}: {describe_bucket(table, plan, k)} "
                                       "vanished while loading (pruned by a newer sync?)") from err
        self.version = version
        return version, time.perf_counter() - tail_start


def make_sender(layout: SyncLayout, stage: int, hf_files_from: str | None = None):
    if layout.engine == "checkpoint":
        return CheckpointSender(layout, stage, hf_files_from)
    return BroadcastSender(layout, stage)


def make_receiver(layout: SyncLayout, index: int):
    if layout.engine == "checkpoint":
        return CheckpointReceiver(layout, index)
    return BroadcastReceiver(layout, index)
