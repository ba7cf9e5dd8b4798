"""The stand-in vLLM's engine: its state under pause, sleep, wake and resume, its simulated generation, and the faults
it can be told to have. Served over HTTP by :mod:`timeslice_verl.standin.server`."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from timeslice_verl.standin.weights import Weights

OUTPUT_ID = 120
"""The token id of every token the stand-in generates (its text: ``x``)."""
_GOING_ON = re.compile(r"echo:[^|]*\|x*\Z")
"""A prompt that ends in the stand-in's own output (a completion continued after a cut)."""
GONE_CHECK_S = 0.05
"""How often a request that waits (paused, asleep, no free seat) looks whether its client went away."""


@dataclass
class Faults:
    """What the stand-in does wrong, by endpoint name (``pause``, or ``pause:keep`` for one mode)."""

    hang: str = ""
    """An endpoint that never answers: a broken engine."""
    slow_s: float = 0.0
    """Control calls take effect and answer this late: an overloaded server."""
    slow_on: list[str] = field(default_factory=list)
    """Only these endpoints are slow (empty: every control call)."""
    fail: dict[str, list] = field(default_factory=dict)
    """endpoint → [count, kind]: its next ``count`` calls answer HTTP 500 (``kind`` ``500``), vLLM's 400 (``400``) or
    200 with a body that is not JSON (``garbage``)."""
    die_on: str = ""
    """An endpoint whose call makes the server exit at once: a crash mid-yield."""
    late_on: str = ""
    """An endpoint that takes effect at once and answers only after ``POST /_standin/answer``: a busy API server whose
    engine already paused (vLLM under a load of short requests)."""

    @staticmethod
    def names(path: str, query: dict[str, list[str]]) -> tuple[str, str]:
        name = path.lstrip("/")
        return name, f"{name}:{query.get('mode', [''])[0]}"

    def update(self, data: dict[str, Any]) -> None:
        for key, value in data.items():
            if key == "fail":
                value = {k: list(v) for k, v in value.items()}
            setattr(self, key, value)


class StandinEngine:
    def __init__(self, *, version: str = "0.24.0", dev_mode: bool = True, sleep_in_flight: str = "crash",
                 token_s: float = 0.01, fail_wake_up: bool = False, model: str = "m", faults: Faults | None = None,
                 max_num_seqs: int = 0, knee: int = 0, **fault_kwargs: Any) -> None:
        self.version = version
        self.faults = faults or Faults(**fault_kwargs)
        self.fail_wake_up = fail_wake_up
        self.model = model
        self.wake_up_calls = 0
        self.dev_mode = dev_mode
        self.sleep_in_flight = sleep_in_flight
        self.token_s = token_s
        self.max_num_seqs = max_num_seqs
        """At most this many requests run (the rest wait, as ``num_requests_waiting``); 0: no bound."""
        self.knee = knee
        """Past this many running, a step takes ``token_s × running / knee`` (a GPU past its compute bound): the
        server's tokens/s stop growing there. 0: a step is ``token_s`` at any batch."""
        self.has_pause = tuple(int(x) for x in version.split(".")[:2]) >= (0, 17)
        self.cond = threading.Condition()
        self.sleeping = self.paused = False
        self.running: set[int] = set()
        self.aborting: set[int] = set()
        self.frozen = False  # pause mode=keep or asleep: running requests make no progress
        self.abort_epoch = 0  # bumped by an aborting sleep: fails the requests queued before it
        self.waiting = self.completed = self.aborted = self.sleeps = 0
        self.cancelled = 0
        """Requests whose client went away mid-generation: stopped there, as vLLM aborts them."""
        self.generated = 0
        self.itl_s = 0.0
        """The time between a request's tokens, summed over every token generated (vLLM's inter-token latency
        histogram's ``_sum``; its ``_count`` is ``generated``): the step's length as the server's own metrics give it."""
        self.kv_dropped = 0
        self.pauses: dict[str, int] = {}
        self.control_calls: dict[str, int] = {}
        """Requests to each control path (``/pause``, ``/is_paused`` …): what a yield costs in round trips."""
        self.child_pid = 0
        self.weights = Weights()
        self.late_answer = threading.Event()
        """Set by ``POST /_standin/answer``: the calls ``faults.late_on`` holds back are answered."""
        """The weights' version and the updates pushed in (vLLM's weight-transfer routes)."""
        self._ids = 0

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {
                "sleeping": self.sleeping, "paused": self.paused, "running": len(self.running), "waiting": self.waiting,
                "completed": self.completed, "aborted": self.aborted, "sleeps": self.sleeps, "version": self.version,
                "wake_up_calls": self.wake_up_calls, "pauses": dict(self.pauses), "child_pid": self.child_pid,
                "control_calls": dict(self.control_calls), "weights": self.weights.stats(),
                "generated": self.generated, "itl_s": self.itl_s, "kv_dropped": self.kv_dropped,
                "cancelled": self.cancelled,
                "pid": os.getpid(),
            }

    def generate(self, max_tokens: int, gone: Callable[[], bool] | None = None) -> tuple[int, str]:
        """``gone``: whether the client closed its connection (checked every tick: the request stops there)."""
        check_s = GONE_CHECK_S if gone is not None else None  # nothing to look at: wait for a notify alone
        gone = gone or (lambda: False)
        with self.cond:
            self.waiting += 1
            epoch = self.abort_epoch
            while ((self.paused or self.sleeping or (self.max_num_seqs and len(self.running) >= self.max_num_seqs))
                   and epoch == self.abort_epoch):
                if gone():
                    self.waiting -= 1
                    self.cancelled += 1
                    return 0, "cancelled"
                self.cond.wait(check_s)
            self.waiting -= 1
            if epoch != self.abort_epoch:
                self.aborted += 1
                self.cond.notify_all()
                return 0, "abort"
            self._ids += 1
            rid = self._ids
            self.running.add(rid)
        tokens, reason, at = 0, "length", time.monotonic()
        while tokens < max_tokens:
            step = self.token_s * max(1.0, len(self.running) / self.knee) if self.knee else self.token_s
            chunk = min(max_tokens - tokens, max(1, int(0.02 / step)) if step > 0 else max_tokens)
            time.sleep(step * chunk)  # a tick of at least 20 ms: the stand-in's own CPU stays small at any batch
            with self.cond:
                while self.frozen and rid not in self.aborting and not gone():
                    self.cond.wait(check_s)
                if rid in self.aborting:
                    reason = "abort"
                    break
            if gone():
                reason = "cancelled"
                break
            tokens += chunk
            now = time.monotonic()
            with self.cond:
                self.generated += chunk
                self.itl_s += now - at  # a chunk's tokens came over this span (a pause inside it included, as in vLLM)
            at = now
        with self.cond:
            self.running.discard(rid)
            self.aborting.discard(rid)
            if reason == "abort":
                self.aborted += 1
            elif reason == "cancelled":
                self.cancelled += 1
            else:
                self.completed += 1
            self.cond.notify_all()
        return tokens, reason

    def undelivered(self) -> None:
        """A generation that ended but whose answer never reached its client (it went away): counted as
        ``cancelled``, so ``completed`` counts only requests answered."""
        with self.cond:
            self.completed -= 1
            self.cancelled += 1

    def _abort_all(self) -> None:
        self.aborting |= self.running
        self.cond.notify_all()
        while self.running:
            self.cond.wait()

    def pause(self, mode: str, clear_cache: bool = True) -> None:
        """``clear_cache`` (vLLM's default): with ``keep``, every held request is preempted, its KV cache dropped
        (counted in ``kv_dropped``: vLLM recomputes them at the resume)."""
        with self.cond:
            self.pauses[mode] = self.pauses.get(mode, 0) + 1
            self.paused = True
            if mode == "keep" and clear_cache:
                self.kv_dropped += len(self.running)
            if mode == "abort":
                self._abort_all()
            elif mode == "wait":
                while self.running:
                    self.cond.wait()
            elif mode == "keep":
                self.frozen = True

    def sleep(self, mode: str | None) -> None:
        with self.cond:
            if not self.has_pause or mode is None:  # older vLLM: no modes on /sleep
                if self.running:
                    if self.sleep_in_flight == "crash":
                        print(f"CRASH: /sleep with {len(self.running)} request(s) in flight (vllm#28714)", flush=True)
                        os._exit(70)
                    self._abort_all()
            elif mode == "abort":
                self.abort_epoch += 1
                self._abort_all()
            elif mode == "wait":
                while self.running:
                    self.cond.wait()
            self.frozen = True
            self.sleeping = True
            self.sleeps += 1
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.sleeping = False
            self.frozen = self.paused and self.frozen
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.frozen = self.sleeping
            self.cond.notify_all()

    def answer(self, url_path: str, body: dict[str, Any],
               gone: Callable[[], bool] | None = None) -> tuple[int, dict[str, Any]]:
        """A completion in OpenAI's shape (or vLLM's 404 for a model it does not serve, its 400 for a chat that asks
        both ``continue_final_message`` and ``add_generation_prompt``).

        As vLLM (0.24) answers a request its pause aborted: HTTP 200, ``finish_reason: "abort"``, the text and the
        ``usage`` of the tokens generated so far (and their ``token_ids`` with ``return_token_ids``). The generated
        text is ``echo:<prompt>|`` and one ``x`` a token (id :data:`OUTPUT_ID`); a context that ends in such output —
        a prompt ending ``echo:…|xxx`` or in the id, a chat whose final assistant message is continued — goes on with
        ``x`` alone, so an answer continued after a cut reads as one never cut."""
        model = body.get("model", self.model)
        if model != self.model:
            return 404, {"object": "error", "message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                         "param": None, "code": 404}
        chat = url_path.endswith("/chat/completions")
        if chat and body.get("continue_final_message") and body.get("add_generation_prompt", True):
            return 400, bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        messages = body.get("messages") or [{}]
        prompt = messages[-1].get("content", "") if chat else body.get("prompt", "")
        going_on = (bool(body.get("continue_final_message")) and messages[-1].get("role") == "assistant") if chat else \
            (prompt[-1:] == [OUTPUT_ID] if isinstance(prompt, list) else bool(_GOING_ON.search(str(prompt))))
        before = self.weights.held()
        budget = body.get("max_completion_tokens", body.get("max_tokens", 16)) if chat else body.get("max_tokens", 16)
        tokens, reason = self.generate(int(budget), gone)
        after = self.weights.held()
        text = ("" if going_on else f"echo:{str(prompt)[:64]}|") + "x" * tokens
        n = body.get("n", 1) if isinstance(body.get("n", 1), int) and 1 <= body.get("n", 1) <= 16 else 1
        ids = bool(body.get("return_token_ids"))
        prompt_ids = prompt if isinstance(prompt, list) else [sum(map(ord, w)) % 50_000 for w in str(prompt).split()]
        choices = [{"index": i, "finish_reason": reason,
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                    **({"token_ids": [OUTPUT_ID] * tokens} if ids else {}),
                    **({"prompt_token_ids": prompt_ids} if ids and not chat else {})} for i in range(n)]
        with self.cond:
            self._ids += 1
            rid = self._ids
        return 200, {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model, "choices": choices,
                     **({"prompt_token_ids": prompt_ids} if ids and chat else {}),
                     "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": tokens * n,
                               "total_tokens": len(prompt_ids) + tokens * n},
                     # the stand-in's own field: the weights it generated with ("mixed": an update landed meanwhile)
                     "timeslice_weight_version": before if before == after else "mixed"}


def bad_request(message: str) -> dict[str, Any]:
    """vLLM's answer to a request it refuses (HTTP 400)."""
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


__all__ = ["OUTPUT_ID", "Faults", "StandinEngine", "bad_request"]
