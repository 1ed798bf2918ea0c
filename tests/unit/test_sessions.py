"""Recorded endpoint sessions as experience (rft/explorer/openai_endpoint.py): only sampled ids are
trained, a call that continues the row's ids extends it, one that does not starts a new row."""

from rft.explorer.openai_endpoint import Call, Session, SessionRecorder, session_experiences


def test_a_continuing_conversation_is_one_row_with_only_sampled_ids_trained():
    first = Call(prompt_ids=[1, 2, 3], token_ids=[7, 8], logprobs=[-0.1, -0.2], finish_reason="stop", version=4)
    # the agent appended a message (ids 9, 10) after exactly what was sampled
    second = Call(prompt_ids=[1, 2, 3, 7, 8, 9, 10], token_ids=[11], logprobs=[-0.3], finish_reason="length",
                  version=5, text="x")
    (row,) = session_experiences(Session("s", "g", [first, second], reward=1.0))
    assert row.token_ids == [1, 2, 3, 7, 8, 9, 10, 11]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert row.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert (row.prompt_length, row.turns, row.reward, row.version) == (3, 2, 1.0, 4)  # the oldest call's weights
    assert (row.group_id, row.trajectory_id, row.finish_reason, row.response) == ("g", "s", "length", "x")
    row.check()


def test_a_re_rendered_conversation_starts_a_new_row_of_the_same_trajectory():
    first = Call(prompt_ids=[1, 2, 3], token_ids=[7, 8], logprobs=[-0.1, -0.2], finish_reason="stop", version=4)
    # the chat template re-tokenized the sampled turn differently (7, 8 -> 78): not a continuation
    second = Call(prompt_ids=[1, 2, 3, 78, 9], token_ids=[11], logprobs=[-0.3], finish_reason="stop", version=4)
    rows = session_experiences(Session("s", "g", [first, second], reward=0.0))
    assert [r.token_ids for r in rows] == [[1, 2, 3, 7, 8], [1, 2, 3, 78, 9, 11]]
    assert [r.loss_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert [r.step_index for r in rows] == [0, 1] and {r.trajectory_id for r in rows} == {"s"}


def test_sessions_are_taken_once_and_only_when_rewarded():
    recorder = SessionRecorder()
    call = Call(prompt_ids=[1], token_ids=[2], logprobs=[-0.5], finish_reason="stop", version=0)
    recorder.record("a", "a", call)
    recorder.record("b", "g", call)
    assert not recorder.reward("unknown", 1.0)
    assert recorder.reward("b", 0.5) and recorder.take_rewarded()[0].id == "b"
    assert recorder.take_rewarded() == [] and recorder.open_sessions() == 1
