"""The experience-operator registry and what every operator may be handed, apart from the modules
that fill the registry (operators.py: filters and shaping; review.py: the `review` operator), so
both can register into it without importing each other. Signature and conventions: operators.py."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from rft.buffer.experience import Experience
from rft.registry import Registry

EXPERIENCE_OPERATORS = Registry("experience operator", params=("experiences",),
                                returns="list[Experience] (the rows kept, rewards possibly reshaped)")


@dataclass
class OperatorContext:
    """What an operator may need beyond the rows (passed to operators with a `ctx` parameter)."""

    run_dir: str = ""
    step: int = 0  # the explorer step (global) these rows belong to
    engine: int = 0
    decode: Callable[[list[int]], str] = field(default=lambda ids: "", repr=False)  # token ids -> text


def groups_of(experiences: list[Experience]) -> dict[str, list[Experience]]:
    """Rows by group, groups in order of first appearance."""
    groups: dict[str, list[Experience]] = defaultdict(list)
    for e in experiences:
        groups[e.group_id].append(e)
    return groups
