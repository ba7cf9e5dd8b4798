"""A line a yield cut continues from its kept output: the continued request for each endpoint and prompt kind, the
requests that restart instead, the one completion the user gets, a budget the kept tokens used up — and the stand-in
vLLM answering aborts and continuations as vLLM 0.24 does (what the feeder's tests rely on)."""

from __future__ import annotations

import json

import pytest

from timeslice_verl.batch.resume import CHAT, COMPLETIONS, Partial, Plan, continued, cut, merged, not_resumable, plan
from timeslice_verl.standin.engine import OUTPUT_ID, StandinEngine


def _partial(**kw) -> Partial:
    base = dict(text="echo:p|xxx", tokens=3, token_ids=None, prompt_tokens=1, prompt_token_ids=None, parts=1,
                answer_id="cmpl-1", request_id="r1", model="m", created=5)
    return Partial(**{**base, **kw})


CONTINUED = [
    ("completions text", COMPLETIONS, {"prompt": "p", "max_tokens": 10}, {},
     {"prompt": "pecho:p|xxx", "max_tokens": 7}),
    ("completions ids", COMPLETIONS, {"prompt": [5, 6], "max_tokens": 10}, {"token_ids": [120] * 3},
     {"prompt": [5, 6, 120, 120, 120], "max_tokens": 7}),
    ("text prompt, ids of both", COMPLETIONS, {"prompt": "p", "max_tokens": 10, "min_tokens": 5},
     {"token_ids": [120] * 3, "prompt_token_ids": [9]}, {"prompt": [9, 120, 120, 120], "max_tokens": 7, "min_tokens": 2}),
    ("no budget", COMPLETIONS, {"prompt": "p"}, {}, {"prompt": "pecho:p|xxx"}),
    ("chat", CHAT, {"messages": [{"role": "user", "content": "p"}], "max_completion_tokens": 4},
     {}, {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "echo:p|xxx"}],
          "max_completion_tokens": 1, "continue_final_message": True, "add_generation_prompt": False}),
]


@pytest.mark.parametrize("what, endpoint, body, kept, sent", CONTINUED, ids=[c[0] for c in CONTINUED])
def test_a_cut_line_continues_from_its_kept_output(what, endpoint, body, kept, sent):
    assert continued(endpoint, {"model": "m", **body}, _partial(**kept)) == {"model": "m", **sent}


@pytest.mark.parametrize("budget", ["max_tokens", "max_completion_tokens"])
def test_a_budget_the_kept_tokens_used_up_is_answered_without_a_request(budget):
    body = {"model": "m", "messages": [{"role": "user", "content": "p"}], budget: 3}
    try_ = plan(CHAT, json.dumps(body), _partial().dumps(), True)
    assert try_.body == b"" and try_.answer is not None
    response = json.loads(try_.answer)
    assert response["status_code"] == 200 and response["request_id"] == "r1"
    answer = response["body"]
    assert answer["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                  "message": {"role": "assistant", "content": "echo:p|xxx"}}]
    assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    assert (answer["id"], answer["model"], answer["object"]) == ("cmpl-1", "m", "chat.completion")


RESTART = [
    (COMPLETIONS, {"prompt": "p", "n": 2}), (COMPLETIONS, {"prompt": "p", "best_of": 3}),
    (COMPLETIONS, {"prompt": "p", "logprobs": 0}), (COMPLETIONS, {"prompt": "p", "stream": True}),
    (COMPLETIONS, {"prompt": "p", "echo": True}), (COMPLETIONS, {"prompt": ["a", "b"]}),
    (COMPLETIONS, {"prompt": [[1], [2]]}), (COMPLETIONS, {"prompt": "p", "guided_json": {"type": "object"}}),
    (COMPLETIONS, {"prompt": "p", "prompt_logprobs": 1}),
    (CHAT, {"messages": [], "logprobs": True}), (CHAT, {"messages": [], "top_logprobs": 2}),
    (CHAT, {"messages": [], "response_format": {"type": "json_object"}}),
    (CHAT, {"messages": [], "tools": [{"type": "function"}]}), (CHAT, {"messages": [], "continue_final_message": True}),
    ("/v1/embeddings", {"input": "p"}),
]


@pytest.mark.parametrize("endpoint, body", RESTART)
def test_requests_whose_parts_would_not_join_restart_as_before(endpoint, body):
    assert not_resumable(endpoint, {"model": "m", **body}) is not None
    raw = json.dumps({"model": "m", **body})
    assert plan(endpoint, raw, None, True) == Plan(raw.encode(), False)


def test_resumable_requests_and_the_switch():
    for endpoint, body in [(COMPLETIONS, {"prompt": "p", "n": 1, "logprobs": None}),
                           (CHAT, {"messages": [], "response_format": {"type": "text"}, "logprobs": False})]:
        assert not_resumable(endpoint, body) is None
        raw = json.dumps(body)
        assert plan(endpoint, raw, None, True) == Plan(raw.encode(), True)
        assert plan(endpoint, raw, _partial().dumps(), False) == Plan(raw.encode(), False), "off: restarted as before"


def test_a_prompt_of_ids_asks_for_ids_and_the_user_gets_none_unasked():
    try_ = plan(COMPLETIONS, json.dumps({"prompt": [5, 6], "max_tokens": 8}), None, True)
    assert json.loads(try_.body)["return_token_ids"] is True and try_.strip_ids and try_.ids
    aborted = {"id": "a", "choices": [{"text": "echo:[5, 6]|xx", "finish_reason": "abort", "token_ids": [120, 120],
                                       "prompt_token_ids": [5, 6]}], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    kept = cut(COMPLETIONS, try_, aborted, "r1")
    assert kept is not None and (kept.token_ids, kept.prompt_token_ids, kept.tokens) == ([120, 120], [5, 6], 2)
    going_on = plan(COMPLETIONS, json.dumps({"prompt": [5, 6], "max_tokens": 8}), kept.dumps(), True)
    assert json.loads(going_on.body) == {"prompt": [5, 6, 120, 120], "max_tokens": 6, "return_token_ids": True}
    last = {"id": "b", "object": "text_completion", "choices": [{"index": 0, "text": "xxxxxx", "finish_reason": "length",
            "token_ids": [120] * 6, "prompt_token_ids": [5, 6, 120, 120]}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}
    answer = merged(going_on, last)
    assert answer["choices"] == [{"index": 0, "text": "echo:[5, 6]|" + "x" * 8, "finish_reason": "length"}]
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10} and answer["id"] == "b"
    without_ids = {**aborted, "choices": [{"text": "echo:[5, 6]|xx", "finish_reason": "abort"}]}
    assert cut(COMPLETIONS, try_, without_ids) is None, "ids not given: restarted, never continued as text"


def test_the_user_gets_one_completion_of_every_part():
    body = {"messages": [{"role": "user", "content": "p"}], "max_tokens": 9}
    first = plan(CHAT, json.dumps(body), None, True)
    one = cut(CHAT, first, {"id": "a", "model": "m", "created": 7, "choices": [{"message": {"content": "echo:p|xx"},
                                                                                "finish_reason": "abort"}],
                             "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    second = plan(CHAT, json.dumps(body), one.dumps(), True)
    two = cut(CHAT, second, {"id": "b", "choices": [{"message": {"content": "xxx"}, "finish_reason": "abort"}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 3}}, "r2")
    assert (two.text, two.tokens, two.parts, two.prompt_tokens, two.answer_id, two.request_id) == \
        ("echo:p|xxxxx", 5, 2, 4, "b", "r2")
    assert cut(CHAT, plan(CHAT, json.dumps(body), two.dumps(), True),
               {"choices": [{"finish_reason": "abort", "message": {"content": ""}}],
                "usage": {"completion_tokens": 0}}) is None, "an abort that generated nothing keeps nothing"
    third = plan(CHAT, json.dumps(body), two.dumps(), True)
    assert json.loads(third.body)["max_tokens"] == 4
    answer = merged(third, {"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "xxxx"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 14, "completion_tokens": 4, "total_tokens": 18}})
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "echo:p|" + "x" * 9}
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    assert answer["id"] == "c"


# --------------------------------------------------------------------------- the stand-in, as vLLM answers


def test_the_standin_answers_an_abort_with_what_it_generated_and_continues_it():
    engine = StandinEngine(token_s=0.0)
    status, whole = engine.answer(COMPLETIONS, {"prompt": "p", "max_tokens": 5, "return_token_ids": True})
    assert status == 200 and whole["choices"][0]["text"] == "echo:p|xxxxx"
    assert whole["choices"][0]["token_ids"] == [OUTPUT_ID] * 5 and whole["usage"]["completion_tokens"] == 5
    status, going_on = engine.answer(COMPLETIONS, {"prompt": "pecho:p|xx", "max_tokens": 3})
    assert going_on["choices"][0]["text"] == "xxx", "a prompt ending in its own output goes on from it"
    chat = {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "echo:p|xx"}],
            "continue_final_message": True, "max_tokens": 2}
    status, refused = engine.answer(CHAT, chat)
    assert status == 400 and "Cannot set both `continue_final_message`" in refused["error"]["message"]
    status, answer = engine.answer(CHAT, {**chat, "add_generation_prompt": False})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "xx"
