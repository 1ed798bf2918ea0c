"""Writing a file so that a failure leaves nothing torn behind, and a full disk says so.

Checkpoints and experience shards are written under a temporary name and renamed into place
(rft/runtime/checkpoint.py, rft/buffer/shards.py). When the write fails, the temporary file goes too: a
full filesystem must not be made fuller by half-written files, nor leave one a later run could
mistake for data. A full filesystem, an exhausted quota and a file-size limit (`ulimit -f`) end the
rank with a StorageFullError naming the file and saying what to do; launching again after space is
freed resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

FULL = {errno.ENOSPC: "the filesystem is full", errno.EDQUOT: "the disk quota is used up",
        errno.EFBIG: "the file size limit (ulimit -f) is reached"}


class StorageFullError(OSError):
    """No room to write a checkpoint or a shard."""


@contextmanager
def written_whole_or_not_at_all(tmp: str, what: str) -> Iterator[None]:
    """Around writing `tmp` (and renaming it into place): on failure remove `tmp`, and turn a full
    filesystem into a StorageFullError that says what to do."""
    try:
        yield
    except BaseException as err:
        try:
            os.remove(tmp)
        except OSError:
            pass  # renamed already, or never created
        code = _full(err)
        if code is not None:
            raise StorageFullError(
                code, f"{FULL[code]} while writing {what} ({tmp}); nothing half-written was left. "
                "Free space, then launch again with the same run.output_dir: the run resumes from its newest "
                "complete checkpoint") from None
        raise


def fsync_dir(path: str) -> None:
    """Make a rename in `path` durable; some filesystems refuse fsync on directories, which is harmless."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text_atomic(path: str, text: str, what: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, and a crash
    after return keeps it: a temporary file beside it (named by host and pid, so ranks on hosts
    sharing the filesystem never share one), fsync'ed, renamed, the directory fsync'ed. Creates
    the directory. `what` names the file in a full-disk error."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with written_whole_or_not_at_all(tmp, what):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(folder)


def _full(err: BaseException | None) -> int | None:
    """The errno of a full disk in `err` or what it was raised while handling: torch.save turns
    the OSError into a RuntimeError of its zip writer."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in FULL:
            return err.errno
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def append_jsonl(path: str, payload: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(payload) + "\n")


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file ([] if it does not exist); blank lines are skipped."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
