"""The experience buffer: shard files on a shared filesystem, handed over with atomic renames.

Why files and renames: every node of a Slurm job already sees the shared filesystem, and
`rename` within one directory is atomic on POSIX, NFS and Lustre, so it serves as both the
publish step (temp name -> final name) and the lock (ready -> claimed: exactly one consumer's
rename succeeds). No broker process, and the history stays on disk for inspection.

Shard life cycle, by file name (`name` = `step00000012-p003.parquet`):
    .<name>.tmp-*        being written by a producer (ignored by everyone else)
    <name>               ready
    <name>.claimed-c<k>  leased to consumer k; back to ready if not committed within lease_s
    <name>.done          consumed
    <name>.stale         too old to train on (buffer.max_staleness, stale=drop); kept, not trained
    <name>.corrupt       failed its checksum; quarantined so it is not retried forever. Its
                         producer, if still running, writes it again from the copy it keeps of
                         every shard not yet consumed (`resend_quarantined`); the bad bytes stay
                         as <name>.corrupt-<k>
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from rft.config import RFTConfig, buffer_dir
from rft.runtime import faults
from rft.runtime.storage import fsync_dir, written_whole_or_not_at_all

MANIFEST = "manifest.jsonl"
_FORMATS = ("parquet", "arrow")  # Parquet, or an Arrow IPC file (no decode cost, bigger)
_READY = re.compile(r"^step(\d{8,})-p(\d{3,})\.(parquet|arrow)$")
_CLAIMED = re.compile(r"^(step\d{8,}-p\d{3,}\.(?:parquet|arrow))\.claimed-c\d+$")
_RESERVED = ("version", "step")  # columns write() adds itself
_KEEP_AT_MOST = 16  # unconsumed shards a producer keeps a copy of, to write again if quarantined


class ShardCorruptError(RuntimeError):
    """A shard's bytes do not match its manifest entry (truncated copy, disk error, tampering)."""


class LeaseExpiredError(RuntimeError):
    """commit() after the lease ran out and the shard went back to the pool (it may be re-consumed)."""


@dataclass
class Claim:
    """A shard leased to one consumer: commit it, or it returns to the pool after lease_s."""

    path: str  # the claimed file, <root>/<name>.claimed-c<k>
    name: str  # the shard's ready name, e.g. step00000012-p003.parquet
    table: pa.Table
    waited_s: float = 0.0  # time spent waiting for a shard to appear (not buffer I/O)


def _sort_key(name: str) -> tuple[int, int]:
    m = _READY.match(name)
    assert m, name
    return int(m.group(1)), int(m.group(2))  # numeric, so step 10**8 sorts after 99999999


def _column(name: str, values: list) -> pa.Array:
    """Token ids are int32 and logprobs float32 on the wire: half the bytes of Python's defaults."""
    if name.endswith("_ids"):
        kind = pa.list_(pa.int32())
    elif name.endswith("_logprobs"):
        kind = pa.list_(pa.float32())
    else:
        kind = None
    try:
        return pa.array(values, type=kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        want = f" as {kind}" if kind is not None else ""
        raise ValueError(f"experience column {name!r} cannot be stored{want}: {e}") from None


class ExperienceBuffer:
    """Producers `write` one shard per step; consumers `claim`, read `.table`, then `commit`."""

    def __init__(self, root: str, fmt: str = "parquet", lease_s: float = 600.0) -> None:
        if fmt not in _FORMATS:
            raise ValueError(f"buffer format {fmt!r} is not supported; use one of {list(_FORMATS)}")
        if lease_s <= 0:
            raise ValueError(f"buffer lease_s must be positive, got {lease_s}")
        self.root = os.path.abspath(root)
        self.fmt = fmt
        self.lease_s = float(lease_s)
        os.makedirs(self.root, exist_ok=True)
        self._manifest: dict[str, dict] = {}  # shard name -> latest manifest entry
        self._manifest_offset = 0  # bytes of manifest.jsonl already parsed
        self._kept: dict[str, tuple[bytes, dict]] = {}  # a producer's shards not yet consumed: bytes, entry

    @classmethod
    def for_run(cls, cfg: RFTConfig) -> ExperienceBuffer:
        """The run's buffer: buffer.path (by default <run>/buffer), its format and lease."""
        return cls(buffer_dir(cfg), cfg.buffer.format, cfg.buffer.lease_s)

    # ---- producer side ---------------------------------------------------------------------

    def write(self, columns: dict[str, list] | pa.Table, *, step: int, producer: int, version: int) -> str:
        """Publish one shard atomically and return its final path. `columns`: a table (e.g. experience
        rows, rft/buffer/experience.py, which carry their own `version`) or plain columns."""
        if step < 0 or producer < 0:
            raise ValueError(f"step and producer must be >= 0, got step={step}, producer={producer}")
        if isinstance(columns, pa.Table):
            table = self._stamped(columns, step, version)
        else:
            table = self._from_columns(columns, step, version)
        rows = table.num_rows

        name = f"step{step:08d}-p{producer:03d}.{self.fmt}"
        final = os.path.join(self.root, name)
        # A second write of the same (step, producer), in any state, would duplicate experience.
        if self.written(step, producer):
            raise FileExistsError(f"shard {name} already exists in {self.root}: step {step} of producer "
                                  f"{producer} was written before (resumed without advancing the step?)")
        sink = pa.BufferOutputStream()
        if self.fmt == "parquet":
            pq.write_table(table, sink)
        else:
            with ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
        data = sink.getvalue().to_pybytes()
        entry = {"file": name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                 "step": step, "producer": producer, "version": version, "time": time.time()}
        self._forget_consumed()
        self._kept[name] = (data, entry)
        if faults.armed("corrupt_shard", step):  # a disk or network error between checksum and file
            data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        self._publish(name, data, entry)
        return final

    def written(self, step: int, producer: int) -> bool:
        """Whether `producer` wrote its shard of `step`, in any state since (ready, claimed, done, ...)."""
        name = f"step{step:08d}-p{producer:03d}.{self.fmt}"
        return any(n == name or n.startswith(name + ".") for n in os.listdir(self.root))

    def _publish(self, name: str, data: bytes, entry: dict) -> None:
        """Write `data` under a temporary name, record its manifest entry, rename it into place."""
        tmp = os.path.join(self.root, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with written_whole_or_not_at_all(tmp, f"experience shard {name}"):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # Manifest first: a consumer that sees the shard must find its checksum.
            self._append_manifest(entry)
            os.rename(tmp, os.path.join(self.root, name))
        fsync_dir(self.root)

    def _forget_consumed(self) -> None:
        for name in [n for n in self._kept if os.path.exists(os.path.join(self.root, n + ".done"))
                     or os.path.exists(os.path.join(self.root, n + ".stale"))]:
            del self._kept[name]
        while len(self._kept) >= _KEEP_AT_MOST:  # an explorer far ahead of its consumers (mode=explore)
            del self._kept[next(iter(self._kept))]

    def resend_quarantined(self) -> list[str]:
        """Write again, from the copies this producer keeps, its shards a consumer quarantined for
        a bad checksum (the same bytes: the step's experience is trained as if nothing happened).
        Cheap when there is nothing to do (one stat per shard not yet consumed): producers call it
        at every step and while they wait at a meeting. Returns the names written again."""
        resent = []
        for name, (data, entry) in list(self._kept.items()):
            bad = os.path.join(self.root, name + ".corrupt")
            if not os.path.exists(bad):
                continue
            tries = sum(1 for n in os.listdir(self.root) if n.startswith(name + ".corrupt-"))
            os.rename(bad, f"{bad}-{tries + 1}")  # kept for inspection
            self._publish(name, data, {**entry, "time": time.time(), "resent": tries + 1})
            resent.append(name)
        return resent

    @staticmethod
    def _stamped(table: pa.Table, step: int, version: int) -> pa.Table:
        if "step" in table.column_names:
            raise ValueError("experience column 'step' is reserved (write() adds it); rename yours")
        if "version" not in table.column_names:
            table = table.append_column("version", pa.array([version] * table.num_rows, type=pa.int64()))
        return table.append_column("step", pa.array([step] * table.num_rows, type=pa.int64()))

    @staticmethod
    def _from_columns(columns: dict[str, list], step: int, version: int) -> pa.Table:
        if not columns:
            raise ValueError("write() got no columns; pass e.g. {'input_ids': [...], 'reward': [...]}")
        if reserved := [k for k in _RESERVED if k in columns]:
            raise ValueError(f"experience column {reserved[0]!r} is reserved (write() adds it); rename yours")
        lengths = {k: len(v) for k, v in columns.items()}
        rows = next(iter(lengths.values()))
        if any(n != rows for n in lengths.values()):
            raise ValueError(f"experience columns differ in length: {lengths}; every column needs one value per row")
        arrays = {k: _column(k, v) for k, v in columns.items()}
        arrays["version"] = pa.array([version] * rows, type=pa.int64())
        arrays["step"] = pa.array([step] * rows, type=pa.int64())
        return pa.table(arrays)

    def _append_manifest(self, entry: dict) -> None:
        """One write() of one line on an O_APPEND fd; flock where the filesystem supports it
        (Lustre without -o flock raises ENOSYS: then O_APPEND alone must do)."""
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(os.path.join(self.root, MANIFEST), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)  # also drops the lock

    # ---- consumer side ---------------------------------------------------------------------

    def claim(self, consumer: int, timeout_s: float, poll_s: float = 0.02, min_step: int | None = None) -> Claim:
        """Lease the oldest ready shard (by step, then producer), waiting up to `timeout_s`.

        Shards with step < `min_step` are left in the pool untouched.
        """
        start = time.monotonic()
        while True:
            self.release_expired()
            for name in self.pending():
                if min_step is not None and _sort_key(name)[0] < min_step:
                    continue
                waited = time.monotonic() - start
                claim = self._try_claim(name, consumer)
                if claim is not None:
                    claim.waited_s = waited
                    return claim
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise self._no_experience(waited, timeout_s, f"min_step={min_step}")
            time.sleep(min(poll_s, max(0.0, timeout_s - waited)))

    def claim_step(self, consumer: int, producers: list[int], timeout_s: float, poll_s: float = 0.02,
                   lost: Callable[[list[int]], object] | None = None, step: int | None = None) -> list[Claim]:
        """Lease the shards of `step` (default: the oldest step ready), one from each of
        `producers`, once all of them are ready (a job with several engines: each writes its own
        shard of every step, and the trainer trains a step on all of them). Waits up to
        `timeout_s`. `lost(missing)`: which of the producers still missing are gone for good
        (rollout.on_engine_failure=continue); the step is then taken without them. A trainer names
        its step: a shard of it quarantined and not yet written again must not let the next
        step's go first."""
        start, wanted = time.monotonic(), step
        while True:
            self.release_expired()
            ready = self.pending()
            step = wanted if wanted is not None else (_sort_key(ready[0])[0] if ready else None)
            of_step = {_sort_key(n)[1]: n for n in ready if _sort_key(n)[0] == step}
            ready = [n for n in ready if _sort_key(n)[0] == step]
            missing = [p for p in producers if p not in of_step]
            if ready and missing and lost is not None:
                gone = lost(missing)
                missing = [p for p in missing if p not in gone]
            waited = time.monotonic() - start
            if ready and not missing:
                claims = []
                try:
                    for p in producers:
                        if p in of_step:
                            claims.append(self._try_claim(of_step[p], consumer))
                except ShardCorruptError:
                    for claim in filter(None, claims):  # the step is taken whole or not at all
                        self.release(claim)
                    raise
                if any(c is None for c in claims):
                    raise RuntimeError(f"step {step}'s shards in {self.root} were taken by another consumer: "
                                       "one trainer (rank 0) claims a job's experience")
                for claim in claims:
                    claim.waited_s = waited
                return claims
            if waited >= timeout_s:
                detail = f"step {step} has no shard yet from producer(s) {missing}" if step is not None else \
                    f"producers {producers}"
                raise self._no_experience(waited, timeout_s, detail)
            time.sleep(min(poll_s, max(0.0, timeout_s - waited)))

    def _no_experience(self, waited: float, timeout_s: float, detail: str) -> TimeoutError:
        return TimeoutError(
            f"no experience shard became ready in {self.root} after waiting {waited:.1f}s "
            f"(timeout {timeout_s}s, {detail}; {len(self.pending())} ready, "
            f"{len(self._list_claimed())} claimed, {len(self.consumed())} consumed): "
            "are the explorers running and writing to this directory?")

    def _try_claim(self, name: str, consumer: int) -> Claim | None:
        ready = os.path.join(self.root, name)
        path = f"{ready}.claimed-c{consumer}"
        try:
            os.rename(ready, path)  # the lock: only one consumer's rename finds the ready file
            now = time.time()
            os.utime(path, (now, now))  # the lease starts now, not when the shard was written
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None  # another consumer won, or (narrow race) a stale-lease sweep took it back
        entry = self._manifest_entry(name)
        digest = hashlib.sha256(data).hexdigest()
        if entry is None or (len(data), digest) != (entry["bytes"], entry["sha256"]):
            # Quarantine, or an expired lease would hand the same bad shard out forever.
            os.rename(path, f"{ready}.corrupt")
            expected = "no manifest entry" if entry is None else f"{entry['bytes']} bytes, sha256 {entry['sha256']}"
            raise ShardCorruptError(f"shard {ready} is corrupt: {len(data)} bytes, sha256 {digest}; "
                                    f"{MANIFEST} says {expected}; moved to {name}.corrupt")
        reader = pa.BufferReader(data)
        table = pq.read_table(reader) if name.endswith(".parquet") else ipc.open_file(reader).read_all()
        return Claim(path=path, name=name, table=table)

    def _manifest_entry(self, name: str) -> dict | None:
        """Parse only the manifest bytes appended since the last call; keep the last entry per file."""
        if name not in self._manifest:
            try:
                with open(os.path.join(self.root, MANIFEST), "rb") as f:
                    f.seek(self._manifest_offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            end = chunk.rfind(b"\n") + 1  # a line still being appended is left for next time
            for line in chunk[:end].splitlines():
                try:
                    entry = json.loads(line)
                    self._manifest[entry["file"]] = entry
                except (ValueError, KeyError, TypeError):
                    continue  # a torn line (producer killed mid-append) must not stop every consumer
            self._manifest_offset += end
        return self._manifest.get(name)

    def commit(self, claim: Claim) -> None:
        """Mark the shard consumed (kept on disk as <name>.done)."""
        try:
            os.rename(claim.path, os.path.join(self.root, claim.name + ".done"))
        except FileNotFoundError:
            raise LeaseExpiredError(
                f"cannot commit {claim.name}: its lease ({self.lease_s}s) expired and it was returned "
                f"to the pool in {self.root}, so it may be consumed again; raise buffer lease_s"
            ) from None

    def release(self, claim: Claim) -> None:
        """Return a claimed shard to the pool untrained, before its lease runs out."""
        with contextlib.suppress(FileNotFoundError):  # the lease ran out and it went back already
            os.rename(claim.path, os.path.join(self.root, claim.name))

    def set_aside_stale(self, claim: Claim) -> None:
        """Mark a claimed shard stale (dropped untrained; kept on disk as <name>.stale)."""
        try:
            os.rename(claim.path, os.path.join(self.root, claim.name + ".stale"))
        except FileNotFoundError:
            raise LeaseExpiredError(f"cannot set aside {claim.name}: its lease ({self.lease_s}s) expired") from None

    def release_expired(self) -> int:
        """Return claimed shards whose lease ran out (consumer died or stalled); how many."""
        released = 0
        now = time.time()
        for claimed in self._list_claimed():
            path = os.path.join(self.root, claimed)
            try:
                st = os.stat(path)
                # ctime moves on rename and utime too, narrowing the window between a claim's
                # rename and its utime in which an old mtime would look expired.
                if now - max(st.st_mtime, st.st_ctime) <= self.lease_s:
                    continue
                os.rename(path, os.path.join(self.root, _CLAIMED.match(claimed).group(1)))
                released += 1
            except FileNotFoundError:
                continue  # committed, or released by someone else, since we listed it
        return released

    # ---- resume ----------------------------------------------------------------------------

    def roll_back(self, producer: int, from_step: int, into: str) -> list[str]:
        """Move `producer`'s shards of step >= `from_step`, in any state, to `<root>/<into>/`.

        A job resumed from the checkpoint of step `from_step` produces those steps again; the
        copies written after that checkpoint (whose training the checkpoint does not contain) are
        kept aside for inspection rather than consumed twice. Returns the moved file names.
        """
        moved = []
        for name in sorted(os.listdir(self.root)):
            m = re.match(r"^\.?(step(\d{8,})-p(\d{3,})\.(?:parquet|arrow))", name)
            if not m or int(m.group(3)) != producer or int(m.group(2)) < from_step:
                continue
            os.makedirs(os.path.join(self.root, into), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.rename(os.path.join(self.root, name), os.path.join(self.root, into, name))
                moved.append(name)
        if moved:
            fsync_dir(self.root)
        return moved

    def reopen(self, producer: int, from_step: int) -> list[str]:
        """Return `producer`'s shards of step >= `from_step` that were consumed, claimed or set
        aside as stale to the pool. A trainer resumed from the checkpoint of step `from_step`
        trains those steps again; with `sync.offset` the explorer wrote them before its own
        checkpoint, so it does not write them again (rft/runtime/schedule.py). Returns the ready names."""
        reopened = []
        for name in sorted(os.listdir(self.root)):
            m = re.match(r"^(step(\d{8,})-p(\d{3,})\.(?:parquet|arrow))\.(?:done|stale|claimed-c\d+)$", name)
            if not m or int(m.group(3)) != producer or int(m.group(2)) < from_step:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.rename(os.path.join(self.root, name), os.path.join(self.root, m.group(1)))
                reopened.append(m.group(1))
        if reopened:
            fsync_dir(self.root)
        return reopened

    def read_consumed(self, name: str) -> pa.Table:
        """A consumed shard's rows again (priority replay, rft/buffer/replay.py), checked against
        its manifest entry: ShardCorruptError if the bytes changed since it was written."""
        path = os.path.join(self.root, name + ".done")
        with open(path, "rb") as f:
            data = f.read()
        entry = self._manifest_entry(name)
        if entry is None or (len(data), hashlib.sha256(data).hexdigest()) != (entry["bytes"], entry["sha256"]):
            raise ShardCorruptError(f"consumed shard {path} no longer matches {MANIFEST}")
        reader = pa.BufferReader(data)
        return pq.read_table(reader) if name.endswith(".parquet") else ipc.open_file(reader).read_all()

    # ---- inspection ------------------------------------------------------------------------

    def pending(self) -> list[str]:
        """Ready shard names, oldest (step, producer) first."""
        return sorted((n for n in os.listdir(self.root) if _READY.match(n)), key=_sort_key)

    def consumed(self) -> list[str]:
        """Committed shard names (without the .done suffix), oldest first."""
        names = [n[: -len(".done")] for n in os.listdir(self.root) if n.endswith(".done")]
        return sorted((n for n in names if _READY.match(n)), key=_sort_key)

    def stale(self) -> list[str]:
        """Shard names set aside as stale (without the .stale suffix), oldest first."""
        names = [n[: -len(".stale")] for n in os.listdir(self.root) if n.endswith(".stale")]
        return sorted((n for n in names if _READY.match(n)), key=_sort_key)

    def _list_claimed(self) -> list[str]:
        return [n for n in os.listdir(self.root) if _CLAIMED.match(n)]
