"""A line a yield cut continues from what it had generated, in the next valley, instead of starting again.

**Where the partial output comes from: vLLM's aborted answer, not a stream.** vLLM (0.24, the v1 engine) ends each
request that ``/pause?mode=abort`` (or ``/sleep`` in ``abort`` mode) cuts with a final output built as any other:
the engine's aborted requests, and ``OutputProcessor.abort_requests``, go through
``RequestState.make_request_output(finish_reason=ABORT)``, which for a non-streamed request (``FINAL_ONLY``) holds the
whole text decoded so far and every token id generated. ``OpenAIServingCompletion`` / ``OpenAIServingChat`` answer it
with HTTP 200, ``finish_reason: "abort"``, ``usage.completion_tokens`` = the tokens generated, and — when the request
asked ``return_token_ids`` — the choice's ``token_ids`` (and ``prompt_token_ids``). A stream would carry nothing more,
and the feeder keeps one request, one answer (its CPU per line).

**How a line continues** (:func:`plan`): ``/v1/completions`` — the prompt followed by the partial output: as token
ids when the prompt was token ids (the feeder asks ``return_token_ids`` for those, and leaves the ids out of the
user's answer unless the user asked) or when vLLM gave the ids of both; as text otherwise (the text is tokenized again:
a token split differently at the cut is the one difference from an answer never cut). ``/v1/chat/completions`` —
the messages and an assistant message holding the partial text, ``continue_final_message: true``,
``add_generation_prompt: false`` (vLLM's prefill of an answer; both true is a 400). ``max_tokens`` /
``max_completion_tokens`` (and ``min_tokens``) are lowered by the tokens kept; a line whose budget the kept tokens
used up is answered without a request, ``finish_reason: "length"``.

**What the user gets** (:func:`merged`): one completion — its text all the parts joined, ``usage.prompt_tokens`` the
original prompt's, ``completion_tokens`` the parts' sum, ``total_tokens`` their sum; the id of the last part's answer.

**What restarts as before** (:func:`not_resumable`): ``n`` or ``best_of`` above 1, logprobs of any kind, ``stream``,
``echo``, several prompts in one request, structured output (its grammar would start again mid-answer), ``tools``
(tool calls are parsed from the whole answer), a chat that already continues its final message — and every line while
``timeslice.batch.resume_partial`` is off. A stop string that spans the cut is not seen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BUDGETS = ("max_tokens", "max_completion_tokens")
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


@dataclass(frozen=True)
class Partial:
    """What the tries a yield cut generated, stored with the line (``lines.partial``, JSON) until it is answered."""

    text: str
    tokens: int
    """Completion tokens kept (never generated again)."""
    token_ids: list[int] | None
    """Their ids, when vLLM gave them for every part."""
    prompt_tokens: int
    """The original prompt's (the first part's usage)."""
    prompt_token_ids: list[int] | None
    parts: int
    answer_id: str
    """The last part's answer: its id, request id, model and time (an answer made without a request carries them)."""
    request_id: str
    model: str
    created: int

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @property
    def usage(self) -> dict[str, int]:
        """What was kept, as an answer's ``usage`` counts it (a line answered without a request)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens}

    @classmethod
    def loads(cls, text: str) -> Partial:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Plan:
    """One try of a line: what is sent, and how its answer is read."""

    body: bytes
    resumable: bool
    """An abort's output is kept (else the line restarts, as before)."""
    partial: Partial | None = None
    """What earlier tries kept: this try continues it."""
    ids: bool = False
    """The prompt is token ids: it goes on with ids alone."""
    strip_ids: bool = False
    """Token ids were asked for the resume alone: left out of the user's answer."""
    answer: str | None = None
    """The line's response without a request: the kept tokens used its whole budget."""

    @property
    def rewrites(self) -> bool:
        """The answer is not the user's as it came: parts to join or ids to leave out."""
        return self.partial is not None or self.strip_ids


def not_resumable(endpoint: str, body: Any) -> str | None:
    """Why a request restarts when cut instead of continuing (None: it continues)."""
    if endpoint not in (COMPLETIONS, CHAT) or not isinstance(body, dict):
        return "not a completion"
    if body.get("stream"):
        return "stream"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n or best_of above 1"
    if body.get("prompt_logprobs") is not None or any(body.get(k) not in (None, "") for k in STRUCTURED):
        return "prompt logprobs or structured output"
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") not in (None, "text"):
        return "structured output"
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if body.get("logprobs") is not None or body.get("echo") or body.get("suffix"):
            return "logprobs, echo or suffix"
        if not isinstance(prompt, str) and not _ids(prompt):
            return "several prompts"
        return None
    if body.get("logprobs") or body.get("top_logprobs") is not None:
        return "logprobs"
    if body.get("tools") or body.get("functions") or body.get("continue_final_message"):
        return "tools, or a final message continued already"
    return None if isinstance(body.get("messages"), list) else "no messages"


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def plan(endpoint: str, raw: str, stored: str | None, enabled: bool) -> Plan:
    """The try of a line of ``endpoint`` whose request is ``raw`` (JSON text), ``stored`` its kept output."""
    if not enabled:
        return Plan(raw.encode(), False)
    body = json.loads(raw)
    if not_resumable(endpoint, body) is not None:
        return Plan(raw.encode(), False)
    ids = endpoint == COMPLETIONS and _ids(body["prompt"])
    strip = ids and not body.get("return_token_ids")
    sent = {**body, "return_token_ids": True} if strip else body
    if stored is None:
        return Plan(json.dumps(sent).encode() if strip else raw.encode(), True, ids=ids, strip_ids=strip)
    partial = Partial.loads(stored)
    more = continued(endpoint, sent, partial)
    if more is None:
        return Plan(b"", True, partial, ids, strip, answer=json.dumps(
            {"status_code": 200, "request_id": partial.request_id, "body": finished(endpoint, partial)}))
    return Plan(json.dumps(more).encode(), True, partial, ids, strip)


def continued(endpoint: str, body: dict[str, Any], partial: Partial) -> dict[str, Any] | None:
    """The request that goes on from ``partial``; None when its tokens used the request's whole budget."""
    out = dict(body)
    for key in BUDGETS:
        if isinstance(out.get(key), int):
            out[key] -= partial.tokens
            if out[key] <= 0:
                return None
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - partial.tokens)
    if endpoint == CHAT:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": partial.text}]
        out.update(continue_final_message=True, add_generation_prompt=False)
    elif partial.token_ids is not None and partial.prompt_token_ids is not None:
        out["prompt"] = partial.prompt_token_ids + partial.token_ids
    elif partial.token_ids is not None and _ids(body["prompt"]):
        out["prompt"] = body["prompt"] + partial.token_ids
    else:
        out["prompt"] = body["prompt"] + partial.text
    return out


def _choice(answer: Any) -> dict[str, Any] | None:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


def _text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    return str((message.get("content") if isinstance(message, dict) else choice.get("text")) or "")


def cut(endpoint: str, try_: Plan, answer: Any, request_id: str = "") -> Partial | None:
    """What a cut answer adds to the line's kept output (None: nothing to keep — the line restarts as before)."""
    choice = _choice(answer)
    usage = (answer.get("usage") if isinstance(answer, dict) else None) or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not try_.resumable or choice is None or not isinstance(tokens, int) or tokens <= 0:
        return None
    ids = choice.get("token_ids") if _ids(choice.get("token_ids")) else None
    if ids is None and try_.ids:
        return None  # a prompt of token ids goes on with ids alone
    last = {"answer_id": str(answer.get("id", "")), "model": str(answer.get("model", "")),
            "created": int(answer.get("created") or 0), "request_id": request_id}
    before = try_.partial
    if before is None:
        prompt_ids = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
        return Partial(_text(choice), tokens, ids, int(usage.get("prompt_tokens") or 0),
                       prompt_ids if _ids(prompt_ids) else None, 1, **last)
    joined = before.token_ids + ids if before.token_ids is not None and ids is not None else None
    return replace(before, text=before.text + _text(choice), tokens=before.tokens + tokens, token_ids=joined,
                   parts=before.parts + 1, **last)


def merged(try_: Plan, answer: dict[str, Any]) -> dict[str, Any]:
    """The user's one completion: the parts kept and this answer joined, the ids asked for the resume left out."""
    out, partial = dict(answer), try_.partial
    choice = dict(_choice(answer) or {})
    usage = dict(answer.get("usage") or {})
    if partial is not None:
        text = partial.text + _text(choice)
        if "message" in choice:
            choice["message"] = {**choice["message"], "content": text}
        else:
            choice["text"] = text
        if partial.token_ids is not None and _ids(choice.get("token_ids")):
            choice["token_ids"] = partial.token_ids + choice["token_ids"]
        for holder in (choice, out):
            if partial.prompt_token_ids is not None and "prompt_token_ids" in holder:
                holder["prompt_token_ids"] = partial.prompt_token_ids
        generated = partial.tokens + int(usage.get("completion_tokens") or 0)
        usage.update(prompt_tokens=partial.prompt_tokens, completion_tokens=generated,
                     total_tokens=partial.prompt_tokens + generated)
        out["usage"] = usage
    if try_.strip_ids:
        for holder in (choice, out):
            holder.pop("token_ids", None)
            holder.pop("prompt_token_ids", None)
    out["choices"] = [choice, *answer["choices"][1:]]
    return out


def finished(endpoint: str, partial: Partial) -> dict[str, Any]:
    """The answer of a line whose kept tokens used its whole budget: completed, ``finish_reason: "length"``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if endpoint == CHAT:
        choice["message"] = {"role": "assistant", "content": partial.text}
    else:
        choice["text"] = partial.text
    return {"id": partial.answer_id, "object": "chat.completion" if endpoint == CHAT else "text_completion",
            "created": partial.created, "model": partial.model, "choices": [choice],
            "usage": {"prompt_tokens": partial.prompt_tokens, "completion_tokens": partial.tokens,
                      "total_tokens": partial.prompt_tokens + partial.tokens}}


__all__ = ["CHAT", "COMPLETIONS", "Partial", "Plan", "continued", "cut", "finished", "merged", "not_resumable", "plan"]
