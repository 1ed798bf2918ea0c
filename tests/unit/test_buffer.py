"""ExperienceBuffer on a real directory: round trips, racing consumers, leases, checksums."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest

from rft.buffer.shards import ExperienceBuffer, LeaseExpiredError, ShardCorruptError


def _columns(n: int, offset: int = 0) -> dict[str, list]:
    return {
        "prompt_ids": [[offset + i, 2**31 - 1] for i in range(n)],
        "response_ids": [list(range(i + 1)) for i in range(n)],
        "response_logprobs": [[-0.5] * (i + 1) for i in range(n)],
        "reward": [float(i) for i in range(n)],
        "text": [f"row{i}" for i in range(n)],
    }


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_write_claim_commit_round_trip(tmp_path, fmt):
    buf = ExperienceBuffer(str(tmp_path / "buf"), fmt=fmt)
    cols = _columns(4)
    path = buf.write(cols, step=3, producer=1, version=2)
    assert os.path.basename(path) == f"step00000003-p001.{fmt}" and os.path.isfile(path)
    assert buf.pending() == [f"step00000003-p001.{fmt}"]

    claim = buf.claim(consumer=0, timeout_s=1.0)
    assert claim.name == f"step00000003-p001.{fmt}"
    assert claim.path.endswith(".claimed-c0") and os.path.isfile(claim.path)
    assert buf.pending() == [] and buf.consumed() == []
    t = claim.table
    assert t.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert t.schema.field("response_ids").type == pa.list_(pa.int32())
    assert t.schema.field("response_logprobs").type == pa.list_(pa.float32())
    assert t.schema.field("version").type == pa.int64() and t.schema.field("step").type == pa.int64()
    for key, values in cols.items():
        assert t.column(key).to_pylist() == values
    assert t.column("version").to_pylist() == [2] * 4 and t.column("step").to_pylist() == [3] * 4

    buf.commit(claim)
    assert buf.consumed() == [claim.name] and buf.pending() == []
    assert os.path.isfile(os.path.join(buf.root, claim.name + ".done")) and not os.path.exists(claim.path)


def test_claims_oldest_first_numerically_and_honours_min_step(tmp_path):
    buf = ExperienceBuffer(str(tmp_path))
    for step, producer in [(10**8, 0), (2, 5), (10, 1), (2, 0)]:
        buf.write({"x": [1]}, step=step, producer=producer, version=0)
    assert buf.claim(0, timeout_s=1.0, min_step=10).name == "step00000010-p001.parquet"
    order = [buf.claim(0, timeout_s=1.0).name for _ in range(3)]
    assert order == ["step00000002-p000.parquet", "step00000002-p005.parquet", "step100000000-p000.parquet"]


def test_a_step_is_claimed_once_every_producer_wrote_it(tmp_path):
    """Several engines: the trainer takes the oldest step's shard from each producer, together."""
    buf = ExperienceBuffer(str(tmp_path / "buf"))
    buf.write(_columns(2), step=3, producer=1, version=3)
    with pytest.raises(TimeoutError, match=r"step 3 has no shard yet from producer\(s\) \[2\]"):
        buf.claim_step(0, [1, 2], timeout_s=0.2)
    buf.write(_columns(1), step=4, producer=2, version=4)  # a newer step does not jump the queue
    buf.write(_columns(3), step=3, producer=2, version=3)
    buf.write(_columns(1), step=4, producer=1, version=4)
    claims = buf.claim_step(0, [1, 2], timeout_s=1.0)
    assert [(c.name, c.table.num_rows) for c in claims] == [("step00000003-p001.parquet", 2),
                                                             ("step00000003-p002.parquet", 3)]
    for claim in claims:
        buf.commit(claim)
    assert [c.name for c in buf.claim_step(0, [1, 2], timeout_s=1.0)] == ["step00000004-p001.parquet",
                                                                           "step00000004-p002.parquet"]


def test_manifest_lines_match_files(tmp_path):
    buf = ExperienceBuffer(str(tmp_path))
    before = time.time()
    paths = [buf.write(_columns(3), step=1, producer=p, version=7) for p in (0, 1)]
    lines = (tmp_path / "manifest.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line, path, producer in zip(lines, paths, (0, 1)):
        entry = json.loads(line)
        data = Path(path).read_bytes()
        assert entry["file"] == os.path.basename(path)
        assert entry["rows"] == 3 and entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert (entry["step"], entry["producer"], entry["version"]) == (1, producer, 7)
        assert before <= entry["time"] <= time.time()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temp files left behind


def test_claim_timeout_raises_with_root_and_wait(tmp_path):
    buf = ExperienceBuffer(str(tmp_path))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=str(tmp_path)) as err:
        buf.claim(consumer=0, timeout_s=0.2)
    assert time.monotonic() - start >= 0.2
    assert "waiting 0.2s" in str(err.value)


def test_expired_lease_returns_uncommitted_claim_to_pool(tmp_path):
    # the lease's length is the buffer's view: a long one while the claim must hold (a loaded machine
    # never outlasts it between two calls), a short one for the consumer that finds it expired
    buf = ExperienceBuffer(str(tmp_path), lease_s=600.0)
    buf.write({"x": [1, 2]}, step=0, producer=0, version=0)
    stale = buf.claim(consumer=0, timeout_s=1.0)
    with pytest.raises(TimeoutError):  # still leased: nobody else may take it
        buf.claim(consumer=1, timeout_s=0.05)
    other = ExperienceBuffer(str(tmp_path), lease_s=0.05)
    deadline = time.monotonic() + 60  # only bounds a hang: the lease runs out 0.05 s after the claim
    while not (released := other.release_expired()):
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.01)
    assert released == 1 and other.pending() == [stale.name]
    fresh = other.claim(consumer=1, timeout_s=1.0)
    assert fresh.name == stale.name and fresh.table.equals(stale.table)
    with pytest.raises(LeaseExpiredError, match=stale.name):
        buf.commit(stale)
    other.commit(fresh)
    assert other.consumed() == [stale.name] and other.pending() == []


def test_claim_itself_releases_expired_leases(tmp_path):
    buf = ExperienceBuffer(str(tmp_path), lease_s=0.2)
    buf.write({"x": [1]}, step=0, producer=0, version=0)
    buf.claim(consumer=0, timeout_s=1.0)  # consumer 0 "dies" without committing
    time.sleep(0.3)
    assert buf.claim(consumer=1, timeout_s=1.0).path.endswith(".claimed-c1")


def test_checksum_mismatch_is_detected_and_quarantined(tmp_path):
    buf = ExperienceBuffer(str(tmp_path))
    path = buf.write(_columns(5), step=0, producer=0, version=0)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="sha256"):
        buf.claim(consumer=0, timeout_s=1.0)
    assert buf.pending() == [] and os.path.exists(path + ".corrupt")


def test_a_quarantined_shard_is_written_again_by_its_producer_and_its_step_taken_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("RFT_FAULTS", "corrupt_shard@3")  # producer 1's shard of step 3 reaches the disk torn
    producers = {p: ExperienceBuffer(str(tmp_path)) for p in (1, 2)}
    for p, buf in producers.items():
        buf.write(_columns(4, offset=10 * p), step=2, producer=p, version=0)
    consumer = ExperienceBuffer(str(tmp_path))
    for claim in consumer.claim_step(0, [1, 2], timeout_s=1.0):
        consumer.commit(claim)
    assert producers[2].resend_quarantined() == []  # nothing quarantined: nothing written
    for p, buf in producers.items():
        buf.write(_columns(4, offset=10 * p), step=3, producer=p, version=1)
    with pytest.raises(ShardCorruptError, match="step00000003-p001"):
        consumer.claim_step(0, [1, 2], timeout_s=1.0)
    assert consumer.pending() == ["step00000003-p002.parquet"]  # the step's other shard went back
    assert producers[2].resend_quarantined() == []  # not its shard
    assert producers[1].resend_quarantined() == ["step00000003-p001.parquet"]
    claims = consumer.claim_step(0, [1, 2], timeout_s=1.0)
    assert [c.table.column("prompt_ids").to_pylist() for c in claims] == \
        [_columns(4, offset=10 * p)["prompt_ids"] for p in (1, 2)]  # the same experience as written
    assert os.path.exists(tmp_path / "step00000003-p001.parquet.corrupt-1")  # the bad bytes, kept
    for claim in claims:
        consumer.commit(claim)
    assert consumer.consumed() == [f"step0000000{s}-p00{p}.parquet" for s in (2, 3) for p in (1, 2)]


def test_a_named_step_waits_for_its_quarantined_shard_while_the_next_steps_is_ready(tmp_path, monkeypatch):
    """The trainer names the step it trains: the next step's shard, written meanwhile (the explorer
    runs ahead with sync.offset), waits its turn; taken first, the run would train out of order."""
    monkeypatch.setenv("RFT_FAULTS", "corrupt_shard@5")  # once per process: another step than the test above
    producer, consumer = ExperienceBuffer(str(tmp_path)), ExperienceBuffer(str(tmp_path))
    producer.write(_columns(4, offset=5), step=5, producer=1, version=0)
    with pytest.raises(ShardCorruptError, match="step00000005-p001"):
        consumer.claim_step(0, [1], timeout_s=1.0, step=5)
    producer.write(_columns(4, offset=6), step=6, producer=1, version=0)
    with pytest.raises(TimeoutError, match="step 5 has no shard yet from producer"):
        consumer.claim_step(0, [1], timeout_s=0.2, step=5)
    assert producer.resend_quarantined() == ["step00000005-p001.parquet"]
    assert [c.name for c in consumer.claim_step(0, [1], timeout_s=1.0, step=5)] == ["step00000005-p001.parquet"]


def _write_under_a_file_size_limit(root: str, conn) -> None:
    from rft.runtime import faults
    from rft.runtime.storage import StorageFullError

    faults.limit_file_size(4096)  # the kernel refuses bigger files (EFBIG), as a full disk would (ENOSPC)
    try:
        ExperienceBuffer(root).write({"x": list(range(100_000))}, step=0, producer=0, version=0)
        conn.send("written")
    except StorageFullError as err:
        conn.send(str(err))


def test_a_full_disk_leaves_no_shard_half_written_and_says_what_to_do(tmp_path):
    here, there = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_write_under_a_file_size_limit, args=(str(tmp_path), there))
    child.start()
    said = here.recv()
    child.join()
    assert "file size limit (ulimit -f) is reached while writing experience shard step00000000-p000" in said
    assert "launch again with the same run.output_dir" in said
    assert [n for n in os.listdir(tmp_path) if n.startswith((".step", "step"))] == []  # no shard, no temp file


def test_shard_without_manifest_entry_is_rejected(tmp_path):
    src = ExperienceBuffer(str(tmp_path / "a"))
    path = src.write({"x": [1]}, step=0, producer=0, version=0)
    dst = ExperienceBuffer(str(tmp_path / "b"))
    os.rename(path, os.path.join(dst.root, os.path.basename(path)))
    with pytest.raises(ShardCorruptError, match="no manifest entry"):
        dst.claim(consumer=0, timeout_s=1.0)


def test_write_rejects_bad_columns_and_duplicates(tmp_path):
    buf = ExperienceBuffer(str(tmp_path))
    with pytest.raises(ValueError, match="'b'"):
        buf.write({"a": [1, 2], "b": [1]}, step=0, producer=0, version=0)
    with pytest.raises(ValueError, match="'version'"):
        buf.write({"version": [1]}, step=0, producer=0, version=0)
    with pytest.raises(ValueError, match="'input_ids'"):
        buf.write({"input_ids": [["a"]]}, step=0, producer=0, version=0)
    with pytest.raises(ValueError, match="'input_ids'"):
        buf.write({"input_ids": [[2**31]]}, step=0, producer=0, version=0)  # does not fit int32
    assert buf.pending() == [] and not (tmp_path / "manifest.jsonl").exists()
    buf.write({"a": [1]}, step=0, producer=0, version=0)
    with pytest.raises(FileExistsError):
        buf.write({"a": [1]}, step=0, producer=0, version=0)
    buf.commit(buf.claim(0, timeout_s=1.0))
    with pytest.raises(FileExistsError):
        buf.write({"a": [1]}, step=0, producer=0, version=0)


def test_bad_format_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="'csv'"):
        ExperienceBuffer(str(tmp_path), fmt="csv")


def _consume_all(root: str, consumer: int, start, out) -> None:
    """Child process: claim and commit until the pool stays empty, reporting what it got."""
    buf = ExperienceBuffer(root)
    start.wait()
    got = []
    while True:
        try:
            claim = buf.claim(consumer, timeout_s=0.5, poll_s=0.001)
        except TimeoutError:
            break
        got.append((claim.name, claim.table.column("prompt_ids").to_pylist()[0][0]))
        buf.commit(claim)
    out.put((consumer, got))


def test_racing_consumers_claim_each_shard_exactly_once(tmp_path):
    root = str(tmp_path)
    buf = ExperienceBuffer(root)
    shards = 40
    for i in range(shards):
        buf.write(_columns(2, offset=1000 * i), step=i // 4, producer=i % 4, version=0)
    ctx = mp.get_context("spawn")  # fork after pyarrow has started threads is unsafe
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_consume_all, args=(root, c, start, out)) for c in range(3)]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    names = [name for got in results.values() for name, _ in got]
    assert len(names) == shards and len(set(names)) == shards
    assert sorted(names) == sorted(buf.consumed()) and buf.pending() == []
    # each claim read the table of the shard it names
    for got in results.values():
        for name, first in got:
            step, producer = int(name[4:12]), int(name[14:17])
            assert first == 1000 * (4 * step + producer)
