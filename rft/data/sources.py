"""Where a taskset's rows come from: a file, a folder or glob of shards laid out as on the Hugging
Face Hub, or a folder `datasets.save_to_disk` wrote; `path@split` picks one split of several.

    data.train_path=train.jsonl                     one file: .jsonl, .json (lines or one array),
                                                    either gzipped (.jsonl.gz, .json.gz), .parquet
    data.train_path=/data/gsm8k@train               a Hub dataset's folder: `data/train-00000-of-00002.parquet`,
                                                    `train/*.parquet`, `train.jsonl`, ... (the split is the
                                                    file's name before its shard number, else its folder's)
    data.train_path=/data/saved@test                save_to_disk of a DatasetDict (dataset_dict.json, a
                                                    folder per split) or of a Dataset (state.json + data-*.arrow)
    data.train_path='/data/gsm8k/data/train-*.parquet'   a glob: its files, in shard order

A source's rows are its shards' rows, concatenated in shard order: a row's index is its position in
the split as if it were one file (jsonl shards count their lines, blank ones included, as one file
of them would), so row indices do not depend on how the split was sharded. Where a split has several
shards, each row is labelled with its shard's file name and its line or row there.

pyarrow reads parquet and the Arrow stream files of save_to_disk: `datasets` is not needed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

SPLIT_SEP = "@"  # `path@split`
# file name endings read as data, longest first so `.jsonl.gz` is not taken for `.gz`
DATA_EXTENSIONS = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet")
_BATCH_ROWS = 4096  # parquet rows decoded at a time: bounded memory on large shards
_SHARD_SUFFIX = re.compile(r"(?:[-_]\d+)+(?:-of-\d+)?$")  # "train-00000-of-00002" -> "train", "part_3" -> "part"

# JSON files of a dataset's folder that describe it rather than hold rows
_METADATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")

Row = tuple[int, str, object]  # (index in the split, location for messages, parsed row or a ValueError)


@dataclass(frozen=True)
class Shard:
    path: str
    kind: str  # jsonl | json | parquet | arrow (an Arrow stream file of save_to_disk)


@dataclass(frozen=True)
class Source:
    """A taskset's files: one split of what `spec` (the config value) names."""

    spec: str  # as configured, e.g. "/data/gsm8k@train"
    split: str | None  # the split read (None: a single file)
    shards: tuple[Shard, ...]

    @property
    def folder(self) -> str:
        """The taskset's folder: the one named (less its split), or the named file's; where paths in
        its rows (images) start."""
        named = self.spec[: -len(SPLIT_SEP + self.split)] if self.split and self.spec.endswith(SPLIT_SEP + self.split) \
            else self.spec
        if os.path.isdir(named):
            return os.path.abspath(named)
        return os.path.dirname(os.path.abspath(self.shards[0].path if self.shards else named))


def _natural(path: str) -> list:
    """Sort key: numbers by value, so shard 10 follows shard 9 even without zero padding."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _kind(path: str) -> str | None:
    lower = path.lower()
    for ext in DATA_EXTENSIONS:
        if lower.endswith(ext):
            return ext.removesuffix(".gz").lstrip(".")
    return None


def _split_name(path: str) -> str:
    """A data file's split, as the Hub names it: the file's name less its shard number
    (`train-00000-of-00002.parquet`, `test.jsonl`), or for a bare shard number (`train/0000.parquet`)
    its folder's name."""
    name = os.path.basename(path)
    stem = _SHARD_SUFFIX.sub("", name[: len(name) - len(next(e for e in DATA_EXTENSIONS if name.lower().endswith(e)))])
    return stem if stem and not stem.isdigit() else os.path.basename(os.path.dirname(os.path.abspath(path)))


def _glob(path: str) -> list[str]:
    """What `path` matches as a glob (`**` spans folders); nothing if it has no wildcard."""
    return glob.glob(path, recursive=True) if any(c in path for c in "*?[") else []


def _saved_dataset(folder: str) -> tuple[str, list[Shard]]:
    """(split, Arrow files) of a folder `Dataset.save_to_disk` wrote: state.json lists its files in order."""
    with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    files = [os.path.join(folder, entry["filename"]) for entry in state.get("_data_files", [])]
    missing = [p for p in files if not os.path.isfile(p)]
    if not files or missing:
        raise ValueError(f"{folder} has a state.json (a `datasets` save_to_disk folder) but its Arrow files "
                         f"{[os.path.basename(p) for p in missing] or '(none listed)'} are missing; save it again")
    return state.get("_split") or os.path.basename(os.path.abspath(folder)), [Shard(p, "arrow") for p in files]


def _saved_splits(folder: str) -> dict[str, list[Shard]]:
    """The splits of a folder `DatasetDict.save_to_disk` wrote: dataset_dict.json lists a subfolder per split."""
    with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
        names = json.load(f).get("splits", [])
    return {name: _saved_dataset(os.path.join(folder, name))[1] for name in names}


def _data_files(paths: list[str], root: str) -> dict[str, list[Shard]]:
    """Data files grouped by split, each split's shards in order; a split found in two folders (a
    Hub dataset's configurations, `main/train-*` and `socratic/train-*`) is refused."""
    splits: dict[str, list[Shard]] = {}
    folders: dict[str, set[str]] = {}
    for path in sorted(paths, key=_natural):
        kind = _kind(path)
        if kind is None or not os.path.isfile(path) or os.path.basename(path) in _METADATA:
            continue
        split = _split_name(path)
        splits.setdefault(split, []).append(Shard(path, kind))
        folder = os.path.dirname(os.path.relpath(path, root))
        if os.path.basename(folder) == split:  # `train/0000.parquet`: the split's own folder
            folder = os.path.dirname(folder)
        folders.setdefault(split, set()).add(folder)
    for split, where in folders.items():
        if len(where) > 1:
            raise ValueError(f"{root} holds split {split!r} in {len(where)} folders ({', '.join(sorted(where))}): "
                             "point the path at one of them")
    return splits


def _folder_splits(folder: str) -> dict[str, list[Shard]]:
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        return _saved_splits(folder)
    if os.path.isfile(os.path.join(folder, "state.json")):
        split, shards = _saved_dataset(folder)
        return {split: shards}
    paths = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]  # .cache, .git, __pycache__: never data
        paths += [os.path.join(top, name) for name in files if not name.startswith((".", "__"))]
    return _data_files(paths, folder)


def _splits(path: str) -> dict[str, list[Shard]]:
    """Every split of a folder or glob (not a single file)."""
    if os.path.isdir(path):
        found = _folder_splits(path)
        what = f"folder {path!r}"
    else:
        root = os.path.dirname(re.split(r"[*?[]", path, maxsplit=1)[0]) or "."  # the folder above the wildcards
        found = _data_files(_glob(path), root)
        what = f"glob {path!r}"
    if not found:
        raise ValueError(f"{what} holds no taskset files (looked for {', '.join(DATA_EXTENSIONS)}, "
                         "or a `datasets` save_to_disk folder)")
    return found


def resolve(spec: str) -> Source:
    """The files `spec` names: a file, or one split of a folder or glob (`spec@split`; the only split
    when there is one). A ValueError names what is wrong and lists the splits found."""
    path, split = spec, None
    head, sep, tail = spec.rpartition(SPLIT_SEP)
    if sep and tail and "/" not in tail and not os.path.exists(spec) and not _glob(spec):
        path, split = head, tail
    if os.path.isfile(path):
        if split is not None:
            raise ValueError(f"{path!r} is one file, one split: drop '{SPLIT_SEP}{split}'")
        kind = _kind(path)
        if kind is None:
            raise ValueError(f"taskset file {path!r} has an unknown extension; use .jsonl, .json, .parquet "
                             "(.jsonl.gz and .json.gz too), a folder of them or a `datasets` save_to_disk folder")
        return Source(spec, None, (Shard(path, kind),))
    if not os.path.isdir(path) and not _glob(path):
        raise ValueError(f"taskset {path!r} does not exist (no such file, folder or glob match)")
    splits = _splits(path)
    if split is None:
        if len(splits) > 1:
            names = sorted(splits)
            example = "train" if "train" in splits else names[0]
            raise ValueError(f"{path!r} holds the splits {names}; name one, e.g. '{path}{SPLIT_SEP}{example}'")
        split = next(iter(splits))
    if split not in splits:
        raise ValueError(f"{path!r} has no split {split!r}; its splits: {sorted(splits)}")
    return Source(spec, split, tuple(splits[split]))


def _jsonl_rows(lines, offset: int, prefix: str) -> Iterator[Row]:
    """(index, "line N", parsed object or a ValueError) per non-blank line; returns the lines read.
    Lines are bytes so a line with invalid UTF-8 is one skipped row, not a crash; blank lines are no
    row but keep their number."""
    count = 0
    for count, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            yield offset + count - 1, f"{prefix}line {count}", json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
            yield offset + count - 1, f"{prefix}line {count}", ValueError(f"invalid JSON ({e.__class__.__name__}: {e})")
    return count


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _json_rows(path: str, offset: int, prefix: str) -> Iterator[Row]:
    """A `.json` file is one object per line, or (starting with '[') one top-level array: the other
    common layout."""
    with _open(path) as f:
        if not f.read(4096).lstrip().startswith(b"["):
            f.seek(0)
            return (yield from _jsonl_rows(f, offset, prefix))
        f.seek(0)
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: starts with '[' but is not a valid JSON array ({e})") from None
    for i, obj in enumerate(data):
        yield offset + i, f"{prefix}row {i}", obj
    return len(data)


def _table_rows(batches, offset: int, prefix: str) -> Iterator[Row]:
    i = 0
    for batch in batches:
        for obj in batch.to_pylist():
            yield offset + i, f"{prefix}row {i}", obj
            i += 1
    return i


def shard_rows(shard: Shard, offset: int = 0, prefix: str = "") -> Iterator[Row]:
    """One file's rows, indexed from `offset`, located with `prefix`; returns the indices it took
    (a jsonl file's lines, blank ones included; else its rows)."""
    if shard.kind == "jsonl":
        with _open(shard.path) as f:
            return (yield from _jsonl_rows(f, offset, prefix))
    if shard.kind == "json":
        return (yield from _json_rows(shard.path, offset, prefix))
    import pyarrow as pa  # imported lazily: jsonl-only users pay nothing
    import pyarrow.parquet as pq

    if shard.kind == "parquet":
        return (yield from _table_rows(pq.ParquetFile(shard.path).iter_batches(batch_size=_BATCH_ROWS), offset, prefix))
    with pa.memory_map(shard.path) as f:  # save_to_disk writes Arrow's streaming format
        return (yield from _table_rows(pa.ipc.open_stream(f), offset, prefix))


def rows(source: Source) -> Iterator[Row]:
    """Every row of `source`, indexed as one file of its shards would be (see the module's doc); with
    several shards, each row's location names its shard."""
    offset = 0
    for shard in source.shards:
        prefix = f"{os.path.basename(shard.path)} " if len(source.shards) > 1 else ""
        offset += yield from shard_rows(shard, offset, prefix)
