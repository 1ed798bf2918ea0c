"""A conversation grows by appending ids: for a chat template, what rft builds turn by turn equals
the template's rendering of the whole conversation (when the model's reply re-tokenizes to the
same ids), and SFT conversations are built the same way."""

import os

import pytest

from rft.data.chat_format import PlainFormat, TemplateFormat, conversation_ids
from rft.models.tiny import build_char_tokenizer

SMOLLM2 = os.path.expanduser("~/.cache/rft/models/smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if not os.path.isfile(os.path.join(SMOLLM2, "tokenizer_config.json")):
        pytest.skip("SmolLM2 not prepared (python tools/prepare_smollm2.py)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2)


def test_template_turns_append_to_what_the_template_renders(smollm2_tokenizer):
    tok = smollm2_tokenizer
    fmt = TemplateFormat(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is 6*7?"}]
    ids = fmt.prompt_ids(messages)
    for reply, follow in (("Let me run it.", {"role": "tool", "content": "42"}),
                          ("It is 42.", {"role": "user", "content": "Sure?"})):
        turn = tok(reply, add_special_tokens=False).input_ids + [end]  # as vLLM samples it: stop token included
        ids += turn + fmt.append_ids([follow], turn)
        messages += [{"role": "assistant", "content": reply}, follow]
    whole = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok(whole, add_special_tokens=False).input_ids


def test_a_turn_cut_by_the_length_limit_is_closed_by_the_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    fmt = TemplateFormat(tok)
    cut = tok("It is", add_special_tokens=False).input_ids  # no stop token: max_new_tokens ran out
    closing = tok.decode(fmt.append_ids([{"role": "user", "content": "go on"}], cut))
    assert closing.startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_sft_conversations_mask_exactly_the_assistant_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    ids, mask, prompt_length = conversation_ids(TemplateFormat(tok), tok, messages)
    trained = [t for t, m in zip(ids, mask) if m]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert trained == tok("4", add_special_tokens=False).input_ids + [end] + tok("6", add_special_tokens=False).input_ids + [end]
    assert not any(mask[:prompt_length]) and mask[prompt_length] == 1


def test_plain_format_concatenates_and_sft_matches_a_sampled_episode():
    tok = build_char_tokenizer()
    fmt = PlainFormat(tok)
    messages = [{"role": "user", "content": "goal 1 0\nat 0 0\n"}, {"role": "assistant", "content": "e"}]
    ids, mask, cut = conversation_ids(fmt, tok, messages)
    assert ids == fmt.prompt_ids(messages[:1]) + tok("e").input_ids + [tok.eos_token_id]
    assert mask == [0] * cut + [1, 1]
    with pytest.raises(ValueError, match="needs at least one message before"):
        conversation_ids(fmt, tok, [{"role": "assistant", "content": "e"}])
