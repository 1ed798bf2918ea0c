"""Plugins given by file path ("path/to/rewards.py:fn"), for every registry: imported from the
file with no PYTHONPATH, once per process under a name every process derives alike; a relative
path made absolute on the login node; a missing file or function, or a file that raises, stops the
launch naming the key, the path and the fix, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rft.buffer.experience import Experience
from rft.config.plugin_checks import absolute_plugin_files, check_rollout_plugins
from rft.config.run import RFTConfig, StageConfig
from rft.data.taskset import Task
from rft.explorer.envs import ENVIRONMENTS
from rft.explorer.rewards import REWARDS, RewardScorer
from rft.explorer.workflows import WORKFLOWS
from rft.registry import absolute_file_spec, file_module_name

PLUGINS = '''
    import os
    LOADS = os.environ.setdefault("RFT_TEST_PLUGIN_LOADS", "")
    os.environ["RFT_TEST_PLUGIN_LOADS"] += "x"  # counts how often the file ran

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's form
        return {"score": float(solution_str.split("=")[-1].strip() == ground_truth), "format": 1.0}

    def reward(trajectory, task):
        return 1.0

    async def flow(task, model, ctx):
        return None

    class Env:
        def reset(self, seed=None, options=None):
            return "", {}
        def step(self, action):
            return "", 0.0, True, False, {}
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A plugin file in a fresh directory, the working directory of the test."""
    (tmp_path / "plugins.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RFT_TEST_PLUGIN_LOADS", raising=False)
    return tmp_path


def test_every_kind_imports_a_file_once_relative_to_the_working_directory(plugins):
    assert REWARDS.resolve("plugins.py:reward").__module__ == file_module_name(str(plugins / "plugins.py"))
    assert WORKFLOWS.resolve("plugins.py:flow").__name__ == "flow"
    assert ENVIRONMENTS.resolve(f"{plugins}/plugins.py:Env").__name__ == "Env"  # a class registry
    # one module for all of them, however the path is spelt
    assert REWARDS.resolve("./sub/../plugins.py:reward") is REWARDS.resolve("plugins.py:reward")
    assert os.environ["RFT_TEST_PLUGIN_LOADS"] == "x"


def test_a_verl_compute_score_in_a_file_scores_in_the_forked_reward_process(plugins):
    response = Experience(token_ids=[], loss_mask=[], logprobs=[], prompt_length=0, response="12+56=68")
    with RewardScorer("plugins.py:compute_score", timeout_s=5) as scorer:
        assert scorer.score([response], [Task(0, "12+56=", "68")]) == [1.0]
    assert response.metrics == {"format": 1.0}


def test_the_module_name_is_the_same_in_every_process(plugins):
    path = str(plugins / "plugins.py")
    other = subprocess.run([sys.executable, "-c", f"from rft.registry import file_module_name; "
                            f"print(file_module_name({path!r}))"], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"}, cwd="/")
    assert other.stdout.strip() == file_module_name(path) == file_module_name("plugins.py")
    assert file_module_name(path) != file_module_name(str(plugins / "sub" / "plugins.py"))


def test_relative_files_become_absolute_for_the_ranks_everywhere_in_the_config(plugins):
    cfg = RFTConfig()
    cfg.algorithm.reward = "plugins.py:compute_score"
    cfg.buffer.replay.priority = "age"
    cfg.stages = [StageConfig(name="a", rollout={"workflow": "flows/agent.py:flow"},
                              data={"operators": [{"name": "ops.py:keep"}, "dedup"]})]
    absolute_plugin_files(cfg, cwd="/launch/here")
    assert cfg.algorithm.reward == "/launch/here/plugins.py:compute_score"
    assert cfg.stages[0].rollout["workflow"] == "/launch/here/flows/agent.py:flow"
    assert cfg.stages[0].data["operators"] == [{"name": "/launch/here/ops.py:keep"}, "dedup"]
    assert cfg.buffer.replay.priority == "age" and cfg.rollout.workflow == "single_turn"
    for unchanged in ("/abs/r.py:fn", "my_pkg.rewards.fn", "exact_match", "data/train.jsonl", "a b.py:fn"):
        assert absolute_file_spec(unchanged, "/x") == unchanged


def rollout_error(key: str, value: str) -> str:
    cfg = RFTConfig()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ValueError) as err:
        check_rollout_plugins("", cfg)
    return str(err.value)


@pytest.mark.parametrize("key, value, message", [
    ("algorithm.reward", "missing.py:fn", "no such file {dir}/missing.py; give the path of a Python file, "
                                          "absolute or relative to the directory you launch from"),
    ("algorithm.reward", "plugins.py:score", "file {dir}/plugins.py has no attribute 'score'; it defines "
                                             "Env, compute_score, flow, reward"),
    ("rollout.workflow", "broken.py:flow", "importing {dir}/broken.py raised KeyError: 'OPENAI_API_KEY' "
                                           "(broken.py line 3); fix the file"),
    ("rollout.workflow", "typo.py:flow", "importing {dir}/typo.py raised SyntaxError"),
    ("algorithm.reward", "gpu_only.py:fn", "importing {dir}/gpu_only.py raised ModuleNotFoundError: No module named "
                                           "'no_such_gpu_lib' (gpu_only.py line 1); install that package where the "
                                           "launcher runs (it imports your code to check it), or import it inside"),
    ("algorithm.reward", "plugins.py", "a file is given as 'path/to/file.py:name'"),
    ("algorithm.reward", "plugins.py:flow", "or verl form fn(data_source, solution_str, ground_truth, extra_info)"),
])
def test_a_bad_file_plugin_stops_the_launch_naming_the_key_and_the_fix(plugins, key, value, message):
    (plugins / "broken.py").write_text("import os\n\nKEY = os.environ['OPENAI_API_KEY']\n")
    (plugins / "typo.py").write_text("async def flow(task, model, ctx)\n    return None\n")
    (plugins / "gpu_only.py").write_text("import no_such_gpu_lib\n")
    text = rollout_error(key, value)
    assert text.startswith(f"{key}={value!r} is invalid: ")
    assert message.format(dir=plugins) in text
    assert "Traceback" not in text
