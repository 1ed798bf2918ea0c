"""Reading one taskset row's fields: dotted keys for nested columns, prompts as text or as chat
messages, answers as text, the system prompt.

Every function returns the value, or raises ValueError with a short reason that names the key; the
reader (rft/data/taskset.py) turns the reason into a skipped row's message.

A dotted key reads a nested field, as the Hub's layouts nest them: `reward_model.ground_truth`
is `row["reward_model"]["ground_truth"]`, `prompt.0.content` the first message's content. A column
whose name holds the dot itself (`"reward_model.ground_truth"`, as a flattened table names it) wins.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

PROMPT_ROLES = ("system", "user", "assistant")  # roles a prompt's messages may have


class MissingKey(ValueError):
    """The row has no such (nested) key."""


def lookup(row: dict, key: str) -> Any:
    """`row[key]`, or for a dotted key the nested field it names (see the module's doc); MissingKey
    names the full key and what the row holds where the path broke."""
    if key in row:
        return row[key]
    node: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = f"row[{'.'.join(walked)!r}]" if walked else "row"
            found = (f"has: {', '.join(sorted(map(str, node))[:8])}" if isinstance(node, dict)
                     else f"has {len(node)} items" if isinstance(node, list) else f"is a {type(node).__name__}")
            raise MissingKey(f"missing key {key!r} ({where} {found})")
        walked.append(part)
    return node


def has_key(row: dict, key: str) -> bool:
    return get(row, key, MissingKey) is not MissingKey


def get(row: dict, key: str, default: Any = None) -> Any:
    """`lookup`, or `default` where the row has no such key."""
    try:
        return lookup(row, key)
    except MissingKey:
        return default


def text_field(row: dict, key: str, what: str = "answer") -> str:
    """A reference/response field as text: strings and numbers (numbers via `str()`)."""
    value = lookup(row, key)
    # bool is an int subclass but True/False as a reference answer is almost surely a data bug.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{what} {key!r} must be a string or number (got {type(value).__name__})")
    if not str(value).strip():
        raise ValueError(f"{what} {key!r} is empty")  # nothing to verify against
    return str(value)


def prompt_messages(value: Any, key: str) -> list[Message]:
    """A chat-message prompt checked: {role, content} messages of PROMPT_ROLES, a system turn only
    first, ending with a user turn that has text. Only role and content are kept (a parquet column
    of messages gives every message every field another one has)."""
    if not value:
        raise ValueError(f"prompt {key!r} is an empty list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{key}[{i}] must be a message {{role, content}} (got {type(m).__name__})")
        role, content = m.get("role"), m.get("content")
        if role not in PROMPT_ROLES:
            raise ValueError(f"{key}[{i}].role is {role!r}; a prompt's messages are {', '.join(PROMPT_ROLES)}")
        if role == "system" and i > 0:
            raise ValueError(f"{key}[{i}] is a system message; only the first message may be one")
        if isinstance(content, list):  # the Hub's chat layout: [{"type": "image"}, {"type": "text", "text": ...}]
            content = _parts_text(content, f"{key}[{i}].content")
        if not isinstance(content, str):
            raise ValueError(f"{key}[{i}].content must be a string or a list of parts (got {type(content).__name__})")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise ValueError(f"prompt {key!r} must end with a user message that has text (the model replies to it)")
    return messages


def _parts_text(parts: list, key: str) -> str:
    """A message's content parts as text, an image part as the `<image>` mark where its image goes
    (rft/data/images.py places the row's images there)."""
    from rft.data.images import MARK

    text = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            text.append(MARK)
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError(f"{key}[{j}] must be a {{type: text, text}} or {{type: image}} part (got {part!r:.60})")
    return "".join(text)


def system_prompt(row: dict, key: str | None, default: str | None) -> str | None:
    """The row's system prompt: its `key` column (`data.system_key`) unless missing, null or blank,
    else `default` (`data.system_prompt`)."""
    value = get(row, key) if key is not None else None
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    if not isinstance(value, str):
        raise ValueError(f"system prompt {key!r} must be a string (got {type(value).__name__})")
    return value
