"""verl's validation set as batch lines (pure), and the scoring of one version's answers."""

from __future__ import annotations

import json
import re

import pytest

from timeslice_verl.validate.valset import Prompt, Sampling, batch_lines, prompts_of, scored

ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
       "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 7}}


@pytest.mark.parametrize("row, message", [
    ({**ROW, "prompt": "2+2?"}, "validation row 0: 'prompt' is not a list of chat messages: 2+2?"),
    ({**ROW, "prompt": []}, "validation row 0: 'prompt' is not a list of chat messages"),
    ({**ROW, "prompt": ["hi"]}, "validation row 0: 'prompt' is not a list of chat messages"),
])
def test_a_row_that_is_not_verls_format_is_refused_by_its_number(row, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        prompts_of([row])


def test_verls_rows_become_prompts_with_their_source_and_ground_truth():
    (p,) = prompts_of([{**ROW, "data_source": None, "reward_model": None}])
    assert (p.uid, p.data_source, p.ground_truth, p.messages) == ("0", "unknown", None, ROW["prompt"])


@pytest.mark.parametrize("val_kwargs, expected", [
    ({}, Sampling(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=64)),  # greedy unless do_sample
    ({"do_sample": False, "temperature": 0.7, "n": 2}, Sampling(n=2, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=64)),
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "n": 4},
     Sampling(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=64)),
])
def test_verls_validation_sampling(val_kwargs, expected):
    config = {"actor_rollout_ref": {"rollout": {"val_kwargs": val_kwargs}}, "data": {"max_response_length": 64}}
    assert Sampling.of(config) == expected


def test_one_chat_line_per_prompt_its_custom_id_naming_version_and_prompt():
    prompts = prompts_of([ROW, ROW])
    lines = [json.loads(x) for x in batch_lines(prompts, 6, "policy", Sampling(n=2, top_k=5, max_tokens=8))]
    assert [x["custom_id"] for x in lines] == ["val-6-0", "val-6-1"]
    assert lines[0]["url"] == "/v1/chat/completions" and lines[0]["body"] == {
        "model": "policy", "messages": ROW["prompt"], "n": 2, "max_tokens": 8, "temperature": 0.0, "top_p": 1.0,
        "top_k": 5}


def _answer(cid: str, *texts: str, error: bool = False) -> dict:
    if error:
        return {"custom_id": cid, "response": None, "error": {"code": "batch_expired", "message": "expired"}}
    return {"custom_id": cid, "response": {"body": {"choices": [{"message": {"content": t}} for t in texts]}},
            "error": None}


def test_every_answer_is_scored_a_failed_line_as_an_empty_answer_and_another_versions_refused():
    prompts = [Prompt("0", "s", [], "4"), Prompt("1", "s", [], "5")]
    score = lambda data_source, solution_str, ground_truth, extra_info: float(solution_str == ground_truth)  # noqa: E731
    got = scored(prompts, 2, [_answer("val-2-0", "4", "3"), _answer("val-2-1", error=True)], score)
    assert got == {"data_sources": ["s", "s", "s"], "uids": ["0", "0", "1"], "infos": {"reward": [1.0, 0.0, 0.0]}}
    with pytest.raises(ValueError, match="'val-3-0' is not of version 2's validation run"):
        scored(prompts, 2, [_answer("val-3-0", "4")], score)
    extra = lambda **kw: {"score": 1.0, "acc": True}  # noqa: E731  (a reward function that returns more)
    assert scored(prompts, 2, [_answer("val-2-1", "x")], extra)["infos"] == {"reward": [1.0], "acc": [True]}
