"""`osprey regenerate`: a chat corpus answered by the target itself, batched, resumable, refused on changed settings."""

import json

import pytest
from conftest import make_tiny_target
from datasets import Dataset
from test_trainers import char_tokenizer

from trainers.corpora.regenerate import RegenerateArguments, _check_manifest, opening, regenerate_split


def _records():
    prompts = ["hi", "tell me a story about cats", "2+2?", "why is the sky blue", "x"]
    return Dataset.from_list(
        [
            {"id": f"c{i}", "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "old"}]}
            for i, p in enumerate(prompts)
        ]
    )


def _greedy_answer(target, tokenizer, head, max_new_tokens):
    ids = tokenizer.apply_chat_template(head, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = target.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_batched_answers_are_the_targets_own_greedy_answers_and_a_rerun_resumes(tmp_path):
    target, tokenizer = make_tiny_target("llama"), char_tokenizer()
    args = RegenerateArguments(
        target_model="tiny", dataset_name="x", output_dir=str(tmp_path), batch_size=3, max_new_tokens=12
    )
    path = tmp_path / "train.jsonl"
    assert regenerate_split(target, tokenizer, _records(), path, args, limit=4) == 4
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({line["id"] for line in lines}) == 4
    for line in lines:
        head = line["messages"][:-1]
        assert line["messages"][-1]["role"] == "assistant" and line["messages"][-1]["content"] != "old"
        assert line["messages"][-1]["content"] == _greedy_answer(target, tokenizer, head, 12)
    # A killed run leaves a torn last line: it is cut off and that conversation answered again.
    path.write_text(path.read_text() + '{"id": "c9", "mess')
    assert regenerate_split(target, tokenizer, _records(), path, args, limit=4) == 0
    assert regenerate_split(target, tokenizer, _records(), path, args, limit=None) == 1
    assert len(path.read_text().splitlines()) == 5


def test_openings_keep_system_turns_and_the_first_user_turn():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert opening(messages) == messages[:2]
    assert opening([{"role": "assistant", "content": "a"}]) is None


def test_resuming_with_other_settings_is_refused(tmp_path):
    _check_manifest(tmp_path, RegenerateArguments(target_model="t", dataset_name="d", max_new_tokens=8))
    _check_manifest(tmp_path, RegenerateArguments(target_model="t", dataset_name="d", max_new_tokens=8))
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        _check_manifest(tmp_path, RegenerateArguments(target_model="t", dataset_name="d", max_new_tokens=9))
