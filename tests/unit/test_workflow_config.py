"""Workflows, environments and rewards are checked at launch: a built-in name or a dotted path
whose signature fits; anything else stops before a process starts, naming the key.
quickstart_agent writes its tasksets from the environment."""

import json

import pytest

from rft.config import stage_configs
from rft.config.checks import validate
from tests.unit.test_config import compose_cfg

HERE = __name__


async def my_workflow(task, model, ctx):
    convo = model.conversation([{"role": "user", "content": task.prompt}])
    await convo.reply()
    return convo.experience()


def sync_workflow(task, model, ctx):
    return None


async def workflow_missing_ctx(task, model):
    return None


def my_reward(trajectory, task):
    return 1.0


def reward_old_signature(response, answer):
    return 1.0


class NotAnEnv:
    def reset(self, seed=None, options=None):
        return "", {}


@pytest.mark.parametrize("override, message", [
    (f"rollout.workflow={HERE}.sync_workflow", "rollout.workflow=.*must be declared `async def`"),
    (f"rollout.workflow={HERE}.workflow_missing_ctx", "rollout.workflow=.*missing parameters: ctx"),
    ("rollout.workflow=multi_trun", "rollout.workflow='multi_trun'.*known: multi_turn, single_turn, step_wise"),
    (f"algorithm.reward={HERE}.reward_old_signature", "algorithm.reward=.*fn\\(trajectory, task\\) -> float"),
    ("algorithm.reward=exact_mtach", "algorithm.reward='exact_mtach'"),
    ("rollout.workflow=multi_turn", "rollout.env=None.*plays an environment"),
    (f"rollout.env={HERE}.NotAnEnv", "rollout.env=.*has no method step"),
    ("rollout.max_turns=0", "rollout.max_turns=0"),
    ("rollout.task_timeout_s=0", "rollout.task_timeout_s=0"),
])
def test_bad_rollout_plugins_fail_at_launch_naming_the_key(tmp_path, override, message):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", override)
    with pytest.raises(ValueError, match=message):
        validate(cfg)


def test_user_workflow_and_reward_by_dotted_path_validate(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}",
                      f"rollout.workflow={HERE}.my_workflow", f"algorithm.reward={HERE}.my_reward")
    validate(cfg)


def test_env_args_the_environment_refuses_are_named(tmp_path):
    cfg = compose_cfg("+experiment=quickstart_agent", f"run.output_dir={tmp_path}", "rollout.env_args.size=30")
    with pytest.raises(ValueError, match="rollout.env_args=.*size=30: use 2 to 10"):
        validate(cfg)


def test_quickstart_agent_writes_its_tasksets_from_the_environment(tmp_path):
    from rft.launch.compose import prepare

    cfg = compose_cfg("+experiment=quickstart_agent", f"run.output_dir={tmp_path}")
    validate(cfg)
    prepare(cfg)
    (_, sft), (_, grpo) = stage_configs(cfg)
    demos = [json.loads(line) for line in open(sft.data.train_path)]
    tasks = [json.loads(line) for line in open(grpo.data.train_path)]
    held_out = [json.loads(line) for line in open(grpo.data.eval_path)]
    assert len(demos) == 4000 and (len(tasks), len(held_out)) == (500, 100)
    assert {(tuple(t["start"]), tuple(t["goal"])) for t in tasks}.isdisjoint(
        {(tuple(t["start"]), tuple(t["goal"])) for t in held_out})
    assert demos[0]["messages"][0]["role"] == "user" and demos[0]["messages"][1]["role"] == "assistant"


def test_a_stage_reading_its_own_file_is_never_overwritten(tmp_path):
    # the stage inherits data.arithmetic from the quickstart's top level but names its own file
    from rft.launch.compose import prepare

    own = tmp_path / "pairs.jsonl"
    own.write_text(json.dumps({"question": "1+1=", "chosen": "2", "rejected": "11"}) + "\n")
    cfg = compose_cfg("+experiment=quickstart", "mode=train", f"run.output_dir={tmp_path / 'run'}",
                      f"stages=[{{name:dpo,algorithm:{{name:dpo,policy_loss:dpo}},data:{{train_path:{own}}},"
                      "trainer:{max_steps:1}}]")
    validate(cfg)
    prepare(cfg)
    assert own.read_text().count("\n") == 1
    assert (tmp_path / "run" / "data" / "train.jsonl").exists()  # the top level's generated set
