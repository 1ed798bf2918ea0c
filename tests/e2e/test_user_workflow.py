"""The README's "Writing a workflow" as a new user does it: a file of their own with a workflow and
a reward, named by dotted path on the command line, runs through the launcher without any change
to rft; a wrong signature stops the launch before anything starts, naming the key."""

import json
import os
import textwrap

from tests.e2e.helpers import launch

USER_FILE = textwrap.dedent('''
    async def ask_twice(task, model, ctx):
        """Ask, then ask the model to check its answer; only the second reply is scored."""
        convo = model.conversation([{"role": "user", "content": task.prompt}])
        await convo.reply()
        convo.add({"role": "user", "content": "=?"})
        await convo.reply(max_new_tokens=4)
        return convo.experience(metrics={"asked": 2.0})

    def exact_answer(trajectory, task):
        return float(trajectory.response.strip() == task.answer) + 0.001 * trajectory.turns

    def old_reward(response, answer):
        return 1.0
''')


def test_a_users_workflow_and_reward_run_by_dotted_path(tmp_path):
    (tmp_path / "my_agent.py").write_text(USER_FILE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "stages=[]", "trainer.max_steps=2",
                    "rollout.tasks_per_step=4", "data.eval_limit=8", "rollout.workflow=my_agent.ask_twice",
                    "algorithm.reward=my_agent.exact_answer", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rollout = [json.loads(line) for line in (run_dir / "metrics" / "rollout1.jsonl").read_text().splitlines()]
    steps = [r for r in rollout if "rollout/turns" in r]
    assert len(steps) == 2 and all(r["rollout/turns"] == 2.0 and r["rollout/asked"] == 2.0 for r in steps)
    trainer = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    assert all(r["reward/mean"] >= 0.002 for r in trainer)  # the user's reward scored every trajectory

    bad = launch("+experiment=quickstart", f"run.output_dir={tmp_path / 'bad'}", "algorithm.reward=my_agent.old_reward",
                 env=env)
    assert bad.returncode == 2
    assert "algorithm.reward='my_agent.old_reward' is invalid" in bad.stderr
    assert "fn(trajectory, task) -> float" in bad.stderr
    assert "Traceback" not in bad.stderr
