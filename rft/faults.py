"""Faults injected on purpose, for the tests and tools/chaos.py: `RFT_FAULTS` in a rank's
environment names what to break and when, e.g.

    RFT_FAULTS=corrupt_shard@35              the shard of step 35 reaches the disk with a flipped byte
    RFT_FAULTS=file_size_limit@45            ranks saving the checkpoint of step 45 first get a 1 MiB
                                             file size limit: the kernel refuses the bigger files with
                                             EFBIG, as a full filesystem would with ENOSPC
    RFT_FAULTS=corrupt_shard@35,corrupt_shard@38

A fault fires at most once per process, at the first time its point is reached at that step.
Points are single lines in the code they break (grep `faults.armed`), so production code pays one
dict lookup. Why not a mock: the run under test is the real one, with real processes and files.
"""

from __future__ import annotations

import os

KINDS = ("corrupt_shard",  # rft/buffer/shards.py: ExperienceBuffer.write
         "file_size_limit")  # rft/checkpoint.py: save_rank_state
_fired: set[tuple[str, int]] = set()


def _parse(spec: str) -> set[tuple[str, int]]:
    faults = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, step = item.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"RFT_FAULTS item {item!r} is not <fault>@<step> with a fault among {list(KINDS)}")
        faults.add((kind, int(step)))
    return faults


def armed(kind: str, step: int) -> bool:
    """True once if `RFT_FAULTS` asks for `kind` at `step` (then the caller acts out the fault)."""
    spec = os.environ.get("RFT_FAULTS")
    if not spec or (kind, step) in _fired or (kind, step) not in _parse(spec):
        return False
    _fired.add((kind, step))
    return True


def limit_file_size(max_bytes: int = 1 << 20) -> None:
    """This process may write no file larger than `max_bytes` from now on (a soft limit: what
    `ulimit -f` sets; CPython ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
