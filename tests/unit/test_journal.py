"""The generation journal without an engine: what one attempt records a later one takes back, a
request is named by its prompt and every sampling parameter (its seed included), a line torn by a
kill costs only that request, and a checkpoint's position prunes the journals it covers."""

import os

from vllm import SamplingParams

from rft.explorer.journal import GenerationJournal, journal_dir, prune_journals, remove_journals
from rft.explorer.vllm_engine import Completion


def _completion(tokens: list[int], version: int = 3) -> Completion:
    return Completion(token_ids=tokens, logprobs=[-0.5] * len(tokens), text="ab", finish_reason="stop",
                      versions=[version] * len(tokens))


def test_a_later_attempt_takes_back_what_an_earlier_one_recorded_for_the_same_draw(tmp_path):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=2)
    first = GenerationJournal(str(tmp_path), rank=1, step=5)
    assert first.replay([1, 2, 3], params) is None
    first.record([1, 2, 3], params, [_completion([4, 5]), _completion([6])])
    first.close()

    again = GenerationJournal(str(tmp_path), rank=1, step=5)
    assert again.replay([1, 2, 3], params) == [_completion([4, 5]), _completion([6])]
    for other_prompt, other_params in (([1, 2], params), ([1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0,
                                                                                      seed=12, n=2)),
                                       ([1, 2, 3], SamplingParams(max_tokens=9, temperature=1.0, seed=11, n=2))):
        assert again.replay(other_prompt, other_params) is None  # another draw
    assert GenerationJournal(str(tmp_path), rank=1, step=6).replay([1, 2, 3], params) is None  # another step
    again.close()


def test_a_line_torn_by_a_kill_loses_only_its_request(tmp_path):
    params = [SamplingParams(max_tokens=4, seed=s) for s in (1, 2)]
    journal = GenerationJournal(str(tmp_path), rank=1, step=0)
    journal.record([7], params[0], [_completion([8])])
    journal.close()
    with open(journal.path, "a") as f:
        f.write('{"key": "torn", "completions": [{"token_ids": [1')
    again = GenerationJournal(str(tmp_path), rank=1, step=0)
    assert again.replay([7], params[0]) == [_completion([8])] and again.replay([7], params[1]) is None
    again.record([7], params[1], [_completion([9])])  # appended after the torn line, read back next time
    again.close()
    assert GenerationJournal(str(tmp_path), rank=1, step=0).replay([7], params[1]) == [_completion([9])]


def test_a_checkpoint_prunes_the_journals_up_to_its_position_and_the_run_end_all(tmp_path):
    for step in (3, 4, 5):
        GenerationJournal(str(tmp_path), rank=2, step=step).close()
    prune_journals(str(tmp_path), rank=2, position=4)
    assert os.listdir(journal_dir(str(tmp_path), 2)) == ["step00000005.jsonl"]
    remove_journals(str(tmp_path), rank=2)
    assert not os.path.exists(journal_dir(str(tmp_path), 2))
