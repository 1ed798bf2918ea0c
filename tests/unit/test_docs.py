"""The documentation site builds with warnings as errors (a broken link or a page left out of the
nav fails), its configuration reference lists every key of the typed config with its default and
doc line, every path a page names exists, the architecture page names every package, and README
stays a landing page."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf._utils import get_yaml_loader

from rft.config import RFTConfig, field_doc

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                            "-d", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return out


class _Rows(HTMLParser):
    """The cells of every table row of a page, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def config_tree_keys() -> dict[str, object]:
    """Every key of the typed config -> its default, walked through OmegaConf (sections that are
    null unless set, and a stage's keys, from their own schema)."""
    from rft.config import ArithmeticTaskConfig, EnvTasksConfig, ShapesTaskConfig, StageConfig, TinyModelConfig

    found: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        for key in node:
            value = node._get_node(key)
            if OmegaConf.is_dict(value) and OmegaConf.get_type(value) not in (dict, None):  # a section
                walk(value, f"{prefix}{key}.")
            elif OmegaConf.is_missing(node, key):
                found[f"{prefix}{key}"] = "???"
            elif value._is_none():
                found[f"{prefix}{key}"] = None
            else:
                found[f"{prefix}{key}"] = OmegaConf.to_container(value) if OmegaConf.is_config(value) \
                    else value._value()

    walk(OmegaConf.structured(RFTConfig), "")
    del found["stages"]
    for key, schema in {"model.tiny": TinyModelConfig, "data.arithmetic": ArithmeticTaskConfig,
                        "data.shapes": ShapesTaskConfig, "data.from_env": EnvTasksConfig,
                        "stages[]": StageConfig}.items():
        walk(OmegaConf.structured(schema), key + ".")
    return found


def test_the_configuration_reference_lists_every_key(site):
    parser = _Rows()
    parser.feed((site / "reference" / "configuration" / "index.html").read_text())
    listed = {row[0]: row for row in parser.rows if len(row) == 4}
    expected = config_tree_keys()
    missing = sorted(set(expected) - set(listed))
    assert not missing, f"keys of the config the reference does not list: {missing}"
    for key, default in expected.items():
        _, _, shown, doc = listed[key]
        # read as Hydra reads a value in YAML or on the command line
        assert shown == "???" if default == "???" else yaml.load(shown, get_yaml_loader()) == default, (key, shown)
        assert doc and doc == field_doc(key).replace("`", ""), (key, doc, field_doc(key))  # `code` renders as code
    extra = sorted(set(listed) - set(expected))
    assert not extra, f"the reference lists keys the config does not have: {extra}"


PATH = re.compile(r"(?<![\w./-])((?:rft|tools|conf|tests|launch|containers|docs)/[\w./-]*[\w/])")


def test_every_path_a_page_names_exists():
    wrong = [f"{page.relative_to(REPO)}: {path}" for page in PAGES for path in PATH.findall(page.read_text())
             if not (REPO / path.rstrip("/")).exists() and "<" not in path]
    assert not wrong, "paths named in the docs that do not exist:\n" + "\n".join(wrong)


def test_the_architecture_page_names_every_package_and_loose_module():
    page = (REPO / "docs" / "reference" / "architecture.md").read_text()
    rft = REPO / "rft"
    parts = [f"rft/{p.parent.relative_to(rft)}/" for p in rft.rglob("__init__.py") if p.parent != rft]
    parts += [f"rft/{p.name}" for p in rft.glob("*.py") if p.name != "__init__.py"]
    unnamed = sorted(p for p in parts if p not in page and p.rstrip("/") + "/" not in page)
    assert not unnamed, f"docs/reference/architecture.md does not name {unnamed}"


def test_readme_is_a_landing_page_with_the_two_commands_first():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:2] == ["Quick start", "Tests"]
    assert "python -m rft.launch +experiment=quickstart" in text.split("## Tests")[0]
    assert 'python -m pytest -n 2 -m "not heavy" tests' in text.split("## Tests")[1].split("##")[0]


def test_nothing_cites_a_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "rft", "tools", "conf", "docs", "tests", "README.md"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    citing = [f for f in files if f != "tests/unit/test_docs.py" and (REPO / f).is_file()
              and "DESIGN.md" in (REPO / f).read_text(errors="ignore")]
    assert not citing, f"these cite DESIGN.md, which is not in the repository: {citing}"
