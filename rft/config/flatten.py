"""A config tree as flat `section.key` -> value text: the parameters trackers log and the keys
`python -m rft.plot` compares runs by."""

from __future__ import annotations

import json
from typing import Any


def flatten(tree: Any) -> dict[str, str]:
    """Nested dicts become dotted keys; a list of named dicts (the stages) becomes one key per name,
    `stages.<name>.<key>`, so two runs' stages compare key by key; other lists and empty dicts are
    JSON text, everything else `str()`."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, list) and node and all(isinstance(s, dict) and "name" in s for s in node):
            for stage in node:
                walk({k: v for k, v in stage.items() if k != "name"}, f"{prefix}{stage['name']}.")
        else:
            out[prefix[:-1]] = json.dumps(node) if isinstance(node, (list, dict)) else str(node)

    walk(tree, "")
    return out
