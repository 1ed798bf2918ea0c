"""rft/runtime/shard_writer.py's refusal of an arena larger than the shared memory left: a page
beyond the room would kill the trainer rank with SIGBUS when first written, not raise."""

import os

import pytest

from rft.runtime.shard_writer import _check_shared_memory


def test_an_arena_larger_than_the_shared_memory_left_is_refused_naming_the_key(tmp_path):
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    _check_shared_memory(free // 2, str(tmp_path))
    with pytest.raises(RuntimeError, match=r"trainer.async_save=false.*--shm-size"):
        _check_shared_memory(free + 2**30, str(tmp_path))
