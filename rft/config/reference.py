"""The config's own documentation: the doc line of every key, read from the comment beside its
field in the schema modules, and the configuration reference the docs site is generated from
(docs/hooks/config_reference.py), so the reference and the code cannot drift apart."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Optional

import yaml
from omegaconf import MISSING
from omegaconf._utils import get_yaml_loader

from rft.config.run import RFTConfig


@dataclass(frozen=True)
class KeyDoc:
    """One key of the config tree as the reference lists it."""

    key: str  # dotted, as on the command line ("trainer.lora.rank"; a stage's: "stages[].name")
    type: str  # the annotation as written in the schema
    default: str  # the default as YAML writes it ("???" where the key must be set)
    doc: str  # the comment beside the field


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on the lines of its definition, for a dataclass of the schema."""
    source = textwrap.dedent(inspect.getsource(cls))
    by_line = {tok.start[0]: tok.string.lstrip("#").strip()
               for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line]
            if lines:
                found[node.target.id] = " ".join(lines)
    return found


def _section_type(hint: Any) -> Optional[type]:
    """The dataclass a field holds (through Optional[...] and list[...]), or None for a leaf."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    inner = args[0] if typing.get_origin(hint) in (typing.Union, list) and len(args) == 1 else hint
    return inner if dataclasses.is_dataclass(inner) else None


def field_doc(key: str) -> Optional[str]:
    """The doc line of a config key such as `model.path` (None for a key the schema lacks)."""
    cls: Any = RFTConfig
    parts = key.replace("[]", "").split(".")
    for part in parts[:-1]:
        cls = _section_type(typing.get_type_hints(cls).get(part))
        if cls is None:
            return None
    return _comments(cls).get(parts[-1])


def yaml_value(value: Any) -> str:
    """A default as a user writes it in YAML or on the command line."""
    if value is MISSING:
        return "???"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # quoted where YAML would read it as something else ("{prompt}", "", "1")
        return value if "\n" not in value and _reads_as(value) == value else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _reads_as(text: str) -> Any:
    """What Hydra's YAML (OmegaConf's loader) makes of `text` written unquoted."""
    try:
        return yaml.load(text, get_yaml_loader())
    except yaml.YAMLError:
        return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING


def config_keys(cls: type = RFTConfig, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key under `cls`, in the schema's order; sections that are null unless set
    (`model.tiny`) and list entries (`stages[]`) list their keys too."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        row = KeyDoc(f"{prefix}{f.name}", annotation, yaml_value(_default(f)), _comments(cls).get(f.name, ""))
        section = _section_type(hints[f.name])
        if section is None:
            keys.append(row)
            continue
        if _default(f) is None:  # a section that is null unless set: the key itself is set too
            keys.append(row)
        is_list = typing.get_origin(hints[f.name]) is list
        keys += config_keys(section, f"{prefix}{f.name}{'[]' if is_list else ''}.")
    return keys


def _code(text: str) -> str:
    """Text for a code cell of a Markdown table (shown as written: nothing can be escaped there)."""
    assert "|" not in text and "`" not in text, f"a reference cell cannot show {text!r} as code"
    return text.replace("\n", " ")


def _cell(text: str) -> str:
    """Text for a Markdown table cell: `|` would end the cell, `<run>` read as an HTML tag and a
    trailing `{...}` as attributes."""
    for char in "|{}*":
        text = text.replace(char, "\\" + char)
    return text.replace("<", "&lt;").replace("\n", " ")


def reference_markdown() -> str:
    """The configuration reference page: one table per top-level section, every key with its
    type, default and doc line."""
    lines = ["# Configuration reference", "",
             "Every key rft understands, generated from the typed config (`rft/config/`) when the site is "
             "built. Set a key on the command line (`trainer.max_steps=200`), in an experiment file under "
             "`conf/experiment/`, or in a config of your own (`--config-dir`). `???` marks a key that must be "
             "set; `null` a section or value that is off unless set. An unknown key fails at launch, naming it.",
             ""]
    hints = typing.get_type_hints(RFTConfig)
    top = [KeyDoc(k.key, k.type, k.default, k.doc) for k in config_keys() if "." not in k.key]
    if top:
        lines += ["## Top level", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{k.key}` | `{_code(k.type)}` | `{_code(k.default)}` | {_cell(k.doc)} |" for k in top]
        lines.append("")
    for f in dataclasses.fields(RFTConfig):
        section = _section_type(hints[f.name])
        if section is None:
            continue
        name = f"{f.name}[]" if typing.get_origin(hints[f.name]) is list else f.name
        lines += [f"## {name}", ""]
        intro = inspect.getdoc(section)
        if intro and not intro.startswith(section.__name__ + "("):  # dataclasses' generated signature
            lines += [" ".join(intro.split()), ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{k.key}` | `{_code(k.type)}` | `{_code(k.default)}` | {_cell(k.doc)} |"
                  for k in config_keys(section, name + ".")]
        lines.append("")
    return "\n".join(lines)
