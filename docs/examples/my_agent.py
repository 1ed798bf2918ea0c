"""The workflow and reward of docs/reference/extending.md and docs/guides/agents.md, as a file the
launcher can be given by path, from the repository's root:

    python -m rft.launch +experiment=quickstart rollout.workflow=docs/examples/my_agent.py:ask_twice \
        algorithm.reward=docs/examples/my_agent.py:exact_answer
"""


async def ask_twice(task, model, ctx):
    """Ask, then ask the model to check its answer; only the second reply is scored."""
    convo = model.conversation([{"role": "user", "content": task.prompt}])
    await convo.reply()                                  # sampled ids appended, trained
    convo.add({"role": "user", "content": "Check your answer and give it again."})   # not trained
    await convo.reply(max_new_tokens=64)
    return convo.experience()                            # reward None: algorithm.reward scores it


def exact_answer(trajectory, task):                      # sees the whole trajectory and the task's row
    return float(trajectory.response.strip() == task.answer)
