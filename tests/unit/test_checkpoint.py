"""Run checkpoints on disk: completeness across ranks, pruning, and setting aside experience
written after the checkpoint a job resumes from."""

import os

import pytest
import torch

from rft.buffer.shards import ExperienceBuffer
from rft.runtime.checkpoint import (
    CorruptCheckpointError,
    newest_complete,
    prune,
    record_requeue,
    requeue_count,
    save_rank_state,
)


def test_newest_complete_skips_a_checkpoint_a_rank_did_not_finish(tmp_path):
    run = str(tmp_path)
    assert newest_complete(run, ranks=[0, 1]) is None
    for rank in (0, 1):
        save_rank_state(run, 10, rank, {"global_step": 10, "rank": rank})
    save_rank_state(run, 20, 0, {"global_step": 20})  # rank 1 died while saving step 20
    resume = newest_complete(run, ranks=[0, 1])
    assert resume.done == 10
    assert resume.load(1) == {"global_step": 10, "rank": 1}
    save_rank_state(run, 20, 1, {"global_step": 20, "w": torch.ones(2)})
    assert newest_complete(run, ranks=[0, 1]).done == 20
    assert torch.equal(newest_complete(run, ranks=[0, 1]).load(1)["w"], torch.ones(2))


def _two_checkpoints(run: str) -> list[str]:
    """Steps 5 and 10 of ranks 0 and 1; the paths of step 10's files."""
    paths = []
    for done in (5, 10):
        paths = [save_rank_state(run, done, rank, {"done": done, "w": torch.full((1000,), float(rank))})
                 for rank in (0, 1)]
    return paths


def test_a_checkpoint_torn_mid_write_is_skipped_for_the_one_before(tmp_path):
    run = str(tmp_path)
    newest = _two_checkpoints(run)
    assert newest_complete(run, ranks=[0, 1]).done == 10
    with open(newest[1], "r+b") as f:  # the filesystem kept only part of it
        f.truncate(os.path.getsize(newest[1]) // 2)
    resume = newest_complete(run, ranks=[0, 1])
    assert resume.done == 5 and resume.load(1)["done"] == 5


def test_a_checkpoint_file_with_flipped_bytes_is_refused_and_set_aside(tmp_path):
    run = str(tmp_path)
    newest = _two_checkpoints(run)
    with open(newest[0], "r+b") as f:  # same size, other bytes: only the checksum tells
        f.seek(os.path.getsize(newest[0]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    resume = newest_complete(run, ranks=[0, 1])
    assert resume.done == 10
    assert resume.load(1)["done"] == 10  # an intact file of it still loads
    with pytest.raises(CorruptCheckpointError, match=r"rank0\.pt does not match the sha256.*launch again"):
        resume.load(0)
    assert os.path.isdir(os.path.join(run, "checkpoints", "step00000010.corrupt"))
    assert newest_complete(run, ranks=[0, 1]).done == 5  # what launching again resumes from


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    run = str(tmp_path)
    for done in (5, 10, 15):
        for rank in (0, 1):
            save_rank_state(run, done, rank, {})
    save_rank_state(run, 20, 0, {})  # incomplete, newer: kept (it may still be being written)
    prune(run, ranks=[0, 1], keep=2)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step00000010", "step00000015", "step00000020"]


def test_requeue_count_is_persisted(tmp_path):
    assert requeue_count(str(tmp_path)) == 0
    assert record_requeue(str(tmp_path), 7) == 1
    assert record_requeue(str(tmp_path), 9) == 2
    assert requeue_count(str(tmp_path)) == 2


def test_roll_back_sets_aside_one_producers_shards_from_a_step_on(tmp_path):
    buf = ExperienceBuffer(str(tmp_path / "buffer"))
    for step in range(4):
        for producer in (1, 2):
            buf.write({"reward": [1.0]}, step=step, producer=producer, version=step)
    for _ in range(3):  # oldest first: step 0 of both producers, step 1 of producer 1
        buf.commit(buf.claim(consumer=0, timeout_s=1))
    claimed = buf.claim(consumer=0, timeout_s=1)  # step 1 producer 2: leased, never committed
    assert claimed.name == "step00000001-p002.parquet"

    moved = buf.roll_back(producer=1, from_step=1, into="rolled_back/x")
    # producer 1's steps 1..3, whether consumed, ready or claimed; producer 2 untouched
    assert sorted(moved) == ["step00000001-p001.parquet.done", "step00000002-p001.parquet",
                             "step00000003-p001.parquet"]
    assert buf.consumed() == ["step00000000-p001.parquet", "step00000000-p002.parquet"]
    assert buf.pending() == ["step00000002-p002.parquet", "step00000003-p002.parquet"]
    # the resumed producer can write step 1 again
    buf.write({"reward": [0.5]}, step=1, producer=1, version=1)
    assert "step00000001-p001.parquet" in buf.pending()


def test_reopen_returns_shards_the_trainer_took_after_its_checkpoint(tmp_path):
    """With sync.offset the explorer's checkpoint holds shards the trainer's does not: on resume
    those go back to the pool, whether consumed, set aside as stale or still claimed."""
    buf = ExperienceBuffer(str(tmp_path / "buffer"))
    for step in range(5):
        buf.write({"reward": [float(step)]}, step=step, producer=0, version=0)
    buf.commit(buf.claim(consumer=0, timeout_s=1))  # step 0: trained before the trainer's checkpoint
    buf.commit(buf.claim(consumer=0, timeout_s=1))  # step 1: trained after it
    buf.set_aside_stale(buf.claim(consumer=0, timeout_s=1))  # step 2: dropped as stale after it
    buf.claim(consumer=0, timeout_s=1)  # step 3: claimed when the job died
    assert buf.stale() == ["step00000002-p000.parquet"]

    reopened = buf.reopen(producer=0, from_step=1)
    assert reopened == [f"step{s:08d}-p000.parquet" for s in (1, 2, 3)]
    assert buf.consumed() == ["step00000000-p000.parquet"] and buf.stale() == []
    assert buf.pending() == [f"step{s:08d}-p000.parquet" for s in range(1, 5)]
    again = buf.claim(consumer=0, timeout_s=1)  # the bytes still match the manifest
    assert again.name == "step00000001-p000.parquet" and again.table.column("reward").to_pylist() == [1.0]
    assert buf.reopen(producer=1, from_step=0) == []  # another producer's shards: none
