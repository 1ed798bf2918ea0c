"""Every `python -m rft.launch` command in README.md and docs/ composes and passes the launcher's
config checks, as a user who copies it would find: a key renamed, a dict key that needs Hydra's `+`,
a value a check refuses each fail here, naming the file and line.

What cannot be taken literally is stood in for: `...` (the rest of a command, whose first words say
what it adds to) becomes `+experiment=quickstart` where no experiment is named; a model directory
gets a stand-in holding the real model's config.json (the checks read only that); data files and
output directories are made under tmp_path; a sweep (`-m a=1,2`) is checked at its first value.
Commands with a `<placeholder>`, or run with `PYTHONPATH=.` for the reader's own module, are left
out. Slurm commands are checked as configs (the cluster itself is tests/slurm's)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rft.config import register_configs
from rft.config.checks import validate
from rft.weights.hf_dir import INDEX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "tests", "unit", "golden", "model_configs")
# a model directory named in the docs -> the config.json of that architecture
MODEL_CONFIGS = {"qwen3-30b-a3b": os.path.join(CONFIGS, "qwen3_30b_a3b.json"),
                 "qwen2.5-vl-7b": os.path.join(CONFIGS, "qwen2_5_vl_7b_instruct.json"),
                 "qwen2.5-vl-3b": os.path.join(CONFIGS, "qwen2_5_vl_3b_instruct.json"),
                 "qwen2.5-7b": os.path.join(CONFIGS, "qwen2_5_7b_instruct.json"),
                 "qwen3-8b": os.path.join(CONFIGS, "qwen3_8b.json"),
                 "llama-3.1-8b": os.path.join(CONFIGS, "llama3_1_8b_instruct.json"),
                 "qwen2.5-1.5b": os.path.join(REPO, "tools", "configs", "qwen2_1.5b.json")}
PRESET_DIRS = {"RFT_QWEN3_30B_A3B_DIR": "qwen3-30b-a3b", "RFT_LLAMA3_1_8B_DIR": "llama-3.1-8b",
               "RFT_QWEN3_8B_DIR": "qwen3-8b", "RFT_QWEN2_5_7B_DIR": "qwen2.5-7b", "RFT_QWEN2_5_1_5B_DIR": "qwen2.5-1.5b",
               "RFT_QWEN2_5_VL_7B_DIR": "qwen2.5-vl-7b", "RFT_QWEN2_5_VL_3B_DIR": "qwen2.5-vl-3b"}
PATH_KEYS = ("model.path", "judge.model", "run.output_dir", "sync.checkpoint_dir", "data.train_path",
             "data.eval_path", "hydra.sweep.dir", "bench.run_dir")


def _commands() -> list[tuple[str, str]]:
    """(file:line, command) for each launch command in a fenced code block of the docs."""
    found = []
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                    recursive=True))]:
        lines, in_code = open(path).read().splitlines(), False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.strip().startswith("```"):
                in_code = not in_code
            elif in_code and "python -m rft.launch" in line:
                start, command = i + 1, line.split("#", 1)[0] if " #" in line else line
                while command.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command.rstrip()[:-1] + " " + lines[i].split(" #", 1)[0]
                found.append((f"{os.path.relpath(path, REPO)}:{start}", command.strip()))
            i += 1
    return found


def _stand_in_model(root: str, name: str) -> str:
    key = next((k for k in MODEL_CONFIGS if k in name.lower()), "qwen2.5-1.5b")
    directory = os.path.join(root, "models", key)
    os.makedirs(directory, exist_ok=True)
    shutil.copy(MODEL_CONFIGS[key], os.path.join(directory, "config.json"))
    return directory


def _overrides(command: str, root: str) -> list[str] | None:
    """The command's overrides as the launcher gets them, stand-ins in place; None: not checkable."""
    if "<" in command or command.startswith("PYTHONPATH=."):
        return None  # a placeholder, or the reader's own module (the guide's my_agent.py)
    words = shlex.split(command[command.index("python -m rft.launch") + len("python -m rft.launch"):])
    sweep = "-m" in words
    overrides = []
    for word in words:
        if word in ("-m", "..."):
            continue
        key, _, value = word.partition("=")
        bare = key.lstrip("+~")
        if sweep and "," in value and not value.startswith(("[", "{")):
            value = value.split(",")[0]  # a sweep: checked at its first value
        if bare in ("model.path", "judge.model"):
            value = _stand_in_model(root, value)
        elif bare == "judge.rubric":
            value = os.path.join(root, "rubric.md")
            open(value, "w").write("Score each answer from 0 to 1.\n")
        elif bare in PATH_KEYS:
            value = os.path.join(root, "paths", value.strip("/").replace("/", "_") or "dir")
            if bare.startswith("data."):
                folder, at, split = value.rpartition("@")  # FOLDER@SPLIT: a folder holding that split
                file = os.path.join(folder, f"{split}.jsonl") if at else value
                os.makedirs(os.path.dirname(file), exist_ok=True)
                open(file, "w").write(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
            elif bare == "bench.run_dir":  # a finished run: the model its last stage left
                os.makedirs(os.path.join(value, "models", "grpo"), exist_ok=True)
                open(os.path.join(value, "models", "grpo", INDEX), "w").write("{}")
        overrides.append(f"{key}={value}")
    if not any(o.startswith("+experiment=") for o in overrides):
        overrides.insert(0, "+experiment=quickstart")
    if not any(o.lstrip("+").startswith("run.output_dir=") for o in overrides):
        overrides.append(f"run.output_dir={os.path.join(root, 'run')}")
    return overrides


COMMANDS = _commands()


def test_the_docs_hold_launch_commands():
    assert len(COMMANDS) >= 40, COMMANDS  # the extraction still finds them


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_launch_command_of_the_docs_composes_and_validates(where, command, tmp_path, monkeypatch, gsm8k_dir):
    for variable, name in PRESET_DIRS.items():
        monkeypatch.setenv(variable, _stand_in_model(str(tmp_path), name))
    overrides = _overrides(command, str(tmp_path))
    if overrides is None:
        pytest.skip("a <placeholder> or the reader's own module stands for something only the reader has")
    register_configs()
    try:
        with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
            cfg = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
        if cfg.cluster.kind == "auto":
            cfg.cluster.kind = "local"
        if cfg.cluster.gpus_per_node is None:
            cfg.cluster.gpus_per_node = 0
        validate(cfg)
    except Exception as err:
        said = re.sub(r"\s+", " ", str(err))[:600]
        raise AssertionError(f"{where}: `{command}` does not launch: {type(err).__name__}: {said}") from None
