"""A stand-in vLLM HTTP server for tests and dry runs (never the tenant of a real run).

It follows the contract the agent relies on (docs/architecture.md §5) including vLLM's failure modes:

* ``/pause?mode=wait`` holds new requests and returns once in-flight ones finished; ``mode=abort``
  ends them with ``finish_reason: "abort"``; ``mode=keep`` freezes them; ``/resume`` admits again;
* ``/sleep?mode=…`` (vLLM ≥ 0.17) pauses with its own mode first — ``abort`` by default, which also
  fails the requests queued while paused; ``keep`` holds them for after ``/resume``;
* older vLLM (``--version`` < 0.17): ``/sleep`` with requests in flight **kills the server**
  (``--sleep-in-flight crash``, vllm#28714) or aborts them (``abort``) — the bug the agent must
  never trigger;
* requests that arrive while paused or asleep wait and are served after ``/wake_up`` + ``/resume``;
* faults on demand: ``--hang`` (an endpoint never answers), ``--slow-s`` (control calls answer late),
  ``--die-on`` (the server exits when an endpoint is called);
* ``--no-dev-mode`` answers 404 on the dev endpoints; ``--version`` < 0.17 has no ``/pause``
  (the agent then drains through ``/metrics``).

Generation is simulated: ``max_tokens`` steps of ``--token-s`` seconds. ``GET /_fake/stats``
reports completed/aborted counts. Run: ``python -m timeslice_verl.testing.fake_vllm --port 0``;
it prints ``listening on http://127.0.0.1:<port>`` once ready.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


CONTROL = ("pause", "resume", "sleep", "wake_up", "is_sleeping", "is_paused", "health")


class FakeVllm:
    def __init__(
        self, *, version: str = "0.24.0", dev_mode: bool = True, sleep_in_flight: str = "crash", token_s: float = 0.01,
        fail_wake_up: bool = False,
        hang: str = "",
        slow_s: float = 0.0,
        die_on: str = "",
    ) -> None:
        self.version = version
        self.hang = hang
        """An endpoint (``pause``, ``health``…, or ``pause:keep`` for one mode) that never answers: a broken engine."""
        self.slow_s = slow_s
        """Every control call (pause, sleep, wake_up, resume, is_*) answers this late: an overloaded server."""
        self.die_on = die_on
        """An endpoint whose call makes the server exit at once: a crash mid-yield."""
        self.fail_wake_up = fail_wake_up
        self.wake_up_calls = 0
        self.dev_mode = dev_mode
        self.sleep_in_flight = sleep_in_flight
        self.token_s = token_s
        nums = tuple(int(x) for x in version.split(".")[:2])
        self.has_pause = nums >= (0, 17)
        self.cond = threading.Condition()
        self.sleeping = False
        self.paused = False
        self.running: set[int] = set()
        self.aborting: set[int] = set()
        self.frozen = False  # pause mode=keep or asleep: running requests make no progress
        self.abort_epoch = 0  # bumped by an aborting sleep: fails the requests queued before it
        self.waiting = 0
        self.completed = 0
        self.aborted = 0
        self.sleeps = 0
        self.pauses: dict[str, int] = {}
        self.child_pid = 0
        self._ids = 0

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {
                "sleeping": self.sleeping, "paused": self.paused, "running": len(self.running), "waiting": self.waiting,
                "completed": self.completed, "aborted": self.aborted, "sleeps": self.sleeps, "version": self.version,
                "wake_up_calls": self.wake_up_calls, "pauses": dict(self.pauses), "child_pid": self.child_pid,
            }

    def generate(self, max_tokens: int) -> tuple[int, str]:
        with self.cond:
            self.waiting += 1
            epoch = self.abort_epoch
            while (self.paused or self.sleeping) and epoch == self.abort_epoch:
                self.cond.wait()
            self.waiting -= 1
            if epoch != self.abort_epoch:
                self.aborted += 1
                self.cond.notify_all()
                return 0, "abort"
            self._ids += 1
            rid = self._ids
            self.running.add(rid)
        tokens, reason = 0, "length"
        for _ in range(max_tokens):
            time.sleep(self.token_s)
            with self.cond:
                while self.frozen and rid not in self.aborting:
                    self.cond.wait()
                if rid in self.aborting:
                    reason = "abort"
                    break
            tokens += 1
        with self.cond:
            self.running.discard(rid)
            self.aborting.discard(rid)
            if reason == "abort":
                self.aborted += 1
            else:
                self.completed += 1
            self.cond.notify_all()
        return tokens, reason

    def _abort_all(self) -> None:
        self.aborting |= self.running
        self.cond.notify_all()
        while self.running:
            self.cond.wait()

    def pause(self, mode: str) -> None:
        with self.cond:
            self.pauses[mode] = self.pauses.get(mode, 0) + 1
            self.paused = True
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


def make_handler(engine: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
            data = (json.dumps(body) if content_type == "application/json" else str(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dev(self) -> bool:
            if not engine.dev_mode:
                self._send(404, {"detail": "Not Found"})
            return engine.dev_mode

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if self._fault(url, parse_qs(url.query)):
                return
            if url.path == "/health":
                self._send(200, {})
            elif url.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
            elif url.path == "/version":
                self._send(200, {"version": engine.version})
            elif url.path == "/metrics":
                s = engine.stats()
                text = (
                    f'vllm:num_requests_running{{model_name="m"}} {float(s["running"])}\n'
                    f'vllm:num_requests_waiting{{model_name="m"}} {float(s["waiting"])}\n'
                )
                self._send(200, text, "text/plain")
            elif url.path == "/is_sleeping":
                if self._dev():
                    self._send(200, {"is_sleeping": engine.stats()["sleeping"]})
            elif url.path == "/is_paused":
                if self._dev():
                    if engine.has_pause:
                        self._send(200, {"is_paused": engine.stats()["paused"]})
                    else:
                        self._send(404, {"detail": "Not Found"})
            elif url.path == "/_fake/stats":
                self._send(200, engine.stats())
            else:
                self._send(404, {"detail": "Not Found"})

        def _fault(self, url: Any, query: dict[str, list[str]]) -> bool:
            """The injected faults; True when the call is never answered."""
            name = url.path.lstrip("/")
            if engine.die_on and name == engine.die_on:
                os._exit(3)
            if engine.slow_s and name in CONTROL:
                time.sleep(engine.slow_s)
            if engine.hang and engine.hang in (name, f"{name}:{query.get('mode', [''])[0]}"):
                time.sleep(3600)  # never answers
                return True
            return False

        def do_POST(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            if self._fault(url, query):
                return
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if url.path in ("/v1/completions", "/v1/chat/completions"):
                try:
                    body = json.loads(raw or b"{}")
                    max_tokens = int(body.get("max_tokens", 16))
                except (ValueError, TypeError):
                    self._send(400, {"detail": "bad request"})
                    return
                tokens, reason = engine.generate(max_tokens)
                self._send(200, {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "x" * tokens, "finish_reason": reason}],
                    "usage": {"completion_tokens": tokens},
                })
                return
            if not self._dev():
                return
            if url.path == "/pause" and engine.has_pause:
                engine.pause(query.get("mode", ["abort"])[0])
                self._send(200, {})
            elif url.path == "/resume" and engine.has_pause:
                engine.resume()
                self._send(200, {})
            elif url.path == "/sleep":
                engine.sleep(query.get("mode", ["abort"])[0] if engine.has_pause else None)
                self._send(200, {})
            elif url.path == "/wake_up":
                with engine.cond:
                    engine.wake_up_calls += 1
                if engine.fail_wake_up:  # a broken engine: every wake-up fails
                    self._send(500, {"detail": "CUDA error: out of memory"})
                    return
                engine.wake()
                self._send(200, {})
            else:
                self._send(404, {"detail": "Not Found"})

    return Handler


class FakeVllmServer:
    """In-process server (a thread) — for the demo's dry run and quick tests."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any) -> None:
        self.engine = FakeVllm(**engine_kwargs)
        self.httpd = ThreadingHTTPServer((host, port), make_handler(self.engine))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fake-vllm", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeVllmServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--version", default="0.24.0", dest="vllm_version")
    ap.add_argument("--no-dev-mode", action="store_true")
    ap.add_argument("--sleep-in-flight", choices=("crash", "abort"), default="crash")
    ap.add_argument("--token-s", type=float, default=0.01)
    ap.add_argument("--fail-wake-up", action="store_true", help="answer every /wake_up with 500 (a broken engine)")
    ap.add_argument("--hang", default="", help="an endpoint that never answers, e.g. wake_up, health, pause or pause:keep")
    ap.add_argument("--slow-s", type=float, default=0.0, help="answer every control call this many seconds late")
    ap.add_argument("--die-on", default="", help="exit at once when this endpoint is called, e.g. pause")
    ap.add_argument("--engine-child", action="store_true",
                    help="start a child process without the TIMESLICE_TENANT tag, as vLLM starts its engine core")
    ap.add_argument("--asleep", action="store_true", help="start paused and asleep (as an agent left it)")
    a = ap.parse_args(argv)
    server = FakeVllmServer(
        a.host, a.port, version=a.vllm_version, dev_mode=not a.no_dev_mode, sleep_in_flight=a.sleep_in_flight, token_s=a.token_s,
        fail_wake_up=a.fail_wake_up, hang=a.hang, slow_s=a.slow_s, die_on=a.die_on,
    )
    if a.asleep:
        server.engine.sleeping = server.engine.paused = server.engine.frozen = True
    if a.engine_child:
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_TENANT"}
        child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], env=env)
        server.engine.child_pid = child.pid
    print(f"listening on {server.url}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
