"""Task selectors (rft/data/selectors.py): what each one draws, and that a saved state resumes the
same draws."""

import numpy as np
import pytest

from rft.config import SelectorConfig
from rft.data.selectors import SELECTORS, build_selector
from rft.data.taskset import Task, TaskCursor


def tasks(n: int, difficulty=None) -> list[Task]:
    return [Task(index=i, prompt=f"q{i}", answer=str(i), row={"difficulty": difficulty(i) if difficulty else i})
            for i in range(n)]


def ids(batch: list[Task]) -> list[int]:
    return [t.index for t in batch]


def test_every_builtin_satisfies_the_contract_and_resumes_its_draws():
    for name in SELECTORS.names():
        config = SelectorConfig(name=name, pace_steps=4)
        selector = build_selector(tasks(50), seed=3, config=config)
        for _ in range(3):
            batch = selector.next_batch(8)
            selector.observe([t.task_id for t in batch], [float(t.index % 2) for t in batch])
        saved = selector.state_dict()
        ahead = [ids(selector.next_batch(8)) for _ in range(4)]
        resumed = build_selector(tasks(50), seed=3, config=config)
        resumed.load_state_dict(saved)
        assert [ids(resumed.next_batch(8)) for _ in range(4)] == ahead, name
        assert all(isinstance(v, float) for v in selector.scalars().values()), name


def test_shuffle_is_the_plain_cursor_and_takes_its_checkpoints():
    cursor, shuffle = TaskCursor(tasks(20), 5), build_selector(tasks(20), 5, SelectorConfig())
    cursor.next_batch(7)
    shuffle.load_state_dict(cursor.state_dict())  # a checkpoint written before selectors existed
    assert ids(shuffle.next_batch(30)) == ids(cursor.next_batch(30))


def test_sequential_walks_the_file_in_order_and_wraps():
    selector = build_selector(tasks(5), 0, SelectorConfig(name="sequential"))
    assert ids(selector.next_batch(3)) + ids(selector.next_batch(4)) == [0, 1, 2, 3, 4, 0, 1]


def test_curriculum_opens_from_the_easiest_tasks_to_all():
    # difficulty descends with the index: the easiest tasks are the last rows of the file
    config = SelectorConfig(name="curriculum", start_fraction=0.1, pace_steps=10)
    selector = build_selector(tasks(100, difficulty=lambda i: 100 - i), 0, config)
    first = ids(selector.next_batch(20))
    assert min(first) >= 90  # only the easiest 10% are open
    for _ in range(9):
        selector.next_batch(20)
    assert selector.open_fraction(10) == 1.0
    late = [i for _ in range(20) for i in ids(selector.next_batch(20))]
    assert min(late) < 20  # the hardest are open now
    assert selector.scalars()["selector/open_fraction"] == 1.0


@pytest.mark.parametrize("pacing, half_open", [("linear", 0.55), ("root", 0.1 + 0.9 * 0.5 ** 0.5), ("step", 0.1)])
def test_curriculum_pacing(pacing, half_open):
    selector = build_selector(tasks(10), 0, SelectorConfig(name="curriculum", start_fraction=0.1, pace_steps=10,
                                                           pacing=pacing))
    assert selector.open_fraction(5) == pytest.approx(half_open)
    assert selector.open_fraction(10) == 1.0


def test_curriculum_names_the_row_without_a_difficulty():
    broken = tasks(3) + [Task(index=3, prompt="q", answer="1", row={"question": "q"})]
    with pytest.raises(ValueError, match=r"difficulty_key='difficulty', but task 3 \(row 3\) has None"):
        build_selector(broken, 0, SelectorConfig(name="curriculum"))


def test_difficulty_prefers_tasks_it_sees_solved_sometimes():
    """Tasks 0-9 are always solved, 10-19 never, 20-29 half the time: after three groups of each
    (pass rates 13/14, 1/14 and 1/2 with the prior), the half-solved ones weigh 8.5 times more
    and are drawn far more often than either of the others."""
    selector = build_selector(tasks(30), 0, SelectorConfig(name="difficulty"))
    for t in tasks(30) * 3:  # three groups of 4 samples each
        rewards = [1.0] * 4 if t.index < 10 else [0.0] * 4 if t.index < 20 else [1.0, 0.0, 1.0, 0.0]
        selector.observe([t.task_id] * 4, rewards)
    assert selector.weights()[25] / selector.weights()[5] == pytest.approx(8.5, abs=0.1)
    drawn = np.bincount([i for _ in range(200) for i in ids(selector.next_batch(5))], minlength=30)
    always, never, half = drawn[:10].sum(), drawn[10:20].sum(), drawn[20:].sum()
    assert half > 4 * max(always, never), (always, never, half)
    assert always > 0 and never > 0  # the floor keeps them in play
    stats = selector.scalars()
    assert stats["selector/always_solved"] == pytest.approx(1 / 3) and stats["selector/never_solved"] == pytest.approx(1 / 3)


def test_variance_weighting_keeps_a_task_solved_once_in_eight_and_drops_one_never_solved():
    """weighting=variance: floor + (1 - floor) 4 p (1 - p). Task 0 solved 1 time in 8, task 1
    never, task 2 always (no prior: prior_samples=0); the Gaussian would weigh task 0 only 3x
    task 1, the variance weighting weighs it 22x."""
    config = SelectorConfig(name="difficulty", weighting="variance", prior_samples=0.0, floor=0.02)
    selector = build_selector(tasks(3), 0, config)
    for task, solved in ((0, 1), (1, 0), (2, 8)):
        selector.observe([str(task)] * 8, [1.0] * solved + [0.0] * (8 - solved))
    w = selector.weights()
    assert w[0] == pytest.approx(0.02 + 0.98 * 4 * (1 / 8) * (7 / 8))
    assert w[1] == w[2] == pytest.approx(0.02)
    gaussian = build_selector(tasks(3), 0, SelectorConfig(name="difficulty", prior_samples=0.0, floor=0.02))
    gaussian.load_state_dict(selector.state_dict())
    g = gaussian.weights()
    assert g[0] / g[1] < 5 < w[0] / w[1]


def test_group_key_draws_new_tasks_from_the_source_whose_tasks_teach_and_resumes_the_same():
    """Tasks 0-49 come from a source whose answers are broken (never solved), 50-99 from one solved
    half the time. With group_key=source and no revisits, the first batch is drawn before anything
    is known, both sources alike; after it, nearly every new task comes from the good source."""
    pool = [Task(index=i, prompt=f"q{i}", answer="", row={"source": "broken" if i < 50 else "good"})
            for i in range(100)]
    config = SelectorConfig(name="difficulty", group_key="source", revisit=0.0, weighting="variance", prior_samples=0.0)
    selector = build_selector(pool, 0, config)

    def run(selector, batches):
        drawn = []
        for _ in range(batches):
            batch = ids(selector.next_batch(8))
            for i in batch:
                selector.observe([str(i)] * 4, [0.0] * 4 if i < 50 else [1.0, 0.0, 1.0, 0.0])
            drawn.append(batch)
        return drawn

    first = run(selector, 1)[0]
    assert 2 <= sum(i < 50 for i in first) <= 6  # nothing known yet: both sources alike
    saved = selector.state_dict()
    later = run(selector, 5)
    assert sum(i >= 50 for batch in later for i in batch) >= 38  # of 40
    assert len({i for batch in [first, *later] for i in batch}) == 48  # every one a new task
    assert selector.scalars()["selector/new_from/good"] >= 0.875
    resumed = build_selector(pool, 0, config)
    resumed.load_state_dict(saved)
    assert run(resumed, 5) == later


def test_group_key_naming_no_column_says_which_columns_there_are():
    with pytest.raises(ValueError, match=r"group_key='source' names a column no task has.*difficulty"):
        build_selector(tasks(5), 0, SelectorConfig(name="difficulty", group_key="source"))


def test_difficulty_splits_each_batch_into_new_tasks_and_revisits_of_informative_ones():
    selector = build_selector(tasks(100), 0, SelectorConfig(name="difficulty", revisit=0.5))
    first = ids(selector.next_batch(10))  # nothing drawn yet: all new
    assert len(set(first)) == 10
    for i in first:  # the first task half solved, the others always
        selector.observe([str(i)] * 4, [1.0, 0.0, 1.0, 0.0] if i == first[0] else [1.0] * 4)
    second = ids(selector.next_batch(10))
    new, again = second[:5], second[5:]
    assert not set(new) & set(first) and set(again) <= set(first)  # half new, half revisits
    assert first[0] in again  # the informative one comes back
    assert selector.scalars()["selector/revisited"] == 0.5
    # new tasks walk one seeded order: after 100 new ones every task was met once
    met = set(first) | set(new)
    while len(met) < 100:
        met |= set(ids(selector.next_batch(10))[:5])
    assert selector.drawn == 100 and ids(selector.next_batch(10)) and selector.scalars()["selector/revisited"] == 1.0


def test_difficulty_refuses_a_checkpoint_of_another_taskset():
    selector = build_selector(tasks(10), 0, SelectorConfig(name="difficulty"))
    other = build_selector(tasks(12), 0, SelectorConfig(name="difficulty"))
    with pytest.raises(ValueError, match="num_tasks=12 but this run has num_tasks=10"):
        selector.load_state_dict(other.state_dict())


class EveryOther:
    """A user's selector (by dotted path): the even rows in order, counting the rewards it saw."""

    def __init__(self, tasks, seed, config):
        self.tasks, self.position, self.seen = [t for t in tasks if t.index % 2 == 0], 0, 0

    def next_batch(self, n):
        out = [self.tasks[(self.position + i) % len(self.tasks)] for i in range(n)]
        self.position += n
        return out

    def observe(self, task_ids, rewards):
        self.seen += len(rewards)

    def scalars(self):
        return {"selector/seen": float(self.seen)}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_user_selector_by_dotted_path():
    selector = build_selector(tasks(10), 0, SelectorConfig(name="tests.unit.test_selectors.EveryOther"))
    assert ids(selector.next_batch(4)) == [0, 2, 4, 6]
    assert SELECTORS.meta(type(selector)) == {}  # no ignores_rewards: the explorer tells it rewards


def test_validation_names_bad_selector_settings():
    from rft.config.plugin_checks import check_selector

    with pytest.raises(ValueError, match="data.selector.name"):
        check_selector("", SelectorConfig(name="nope"), rollouts=True)
    with pytest.raises(ValueError, match=r"stages\[sft\].data.selector.name.*rewards of rollouts"):
        check_selector("stages[sft].", SelectorConfig(name="difficulty"), rollouts=False)
    with pytest.raises(ValueError, match="data.selector.target"):
        check_selector("", SelectorConfig(name="difficulty", target=1.5), rollouts=True)
    with pytest.raises(ValueError, match=r"data.selector.weighting='std' is invalid: choose one of \('gaussian', 'variance'\)"):
        check_selector("", SelectorConfig(name="difficulty", weighting="std"), rollouts=True)
