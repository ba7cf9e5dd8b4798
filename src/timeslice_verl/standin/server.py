"""A stand-in vLLM HTTP server on the CPU, to try the agent, supervisor and batch service (never a real tenant).

It follows the contract the agent relies on (docs/architecture.md §5) including vLLM's failure modes:

* ``/pause?mode=wait`` holds new requests and returns once in-flight ones finished; ``mode=abort``
  ends them with ``finish_reason: "abort"``; ``mode=keep`` freezes them; ``/resume`` admits again;
* ``/sleep?mode=…`` (vLLM ≥ 0.17) pauses with its own mode first — ``abort`` by default, which also
  fails the requests queued while paused; ``keep`` holds them for after ``/resume``;
* older vLLM (``--version`` < 0.17): ``/sleep`` with requests in flight **kills the server**
  (``--sleep-in-flight crash``, vllm#28714) or aborts them (``abort``) — the bug the agent must
  never trigger;
* requests that arrive while paused or asleep wait and are served after ``/wake_up`` + ``/resume``;
* ``/v1/completions`` and ``/v1/chat/completions`` answer in OpenAI's shapes for the served ``--model``
  (another model is a 404, as vLLM answers it); the text starts with ``echo:`` and the prompt, so a client
  can tell which request an answer belongs to; a request the pause aborts is answered as vLLM answers it (200,
  ``finish_reason: "abort"``, the text and usage generated so far); ``return_token_ids`` adds the ids, and a
  continued answer (``continue_final_message``, or a prompt ending in the stand-in's own output) goes on from it;
* faults on demand (:class:`Faults`, at start or at run time through ``POST /_standin/fault``): ``hang`` (an
  endpoint never answers), ``slow_s`` (control calls, or those ``slow_on`` names, take effect and answer late),
  ``fail`` (the first N calls of an endpoint answer HTTP 500 or a garbled body), ``die_on`` (the server exits
  when an endpoint is called), ``late_on`` (an endpoint takes effect at once and answers after
  ``POST /_standin/answer``); ``POST /_standin/stop_listening`` closes the listening socket, the process lives on;
* vLLM's weight-transfer routes (:mod:`~timeslice_verl.standin.weights`): the stand-in holds a weight version
  and tags each answer with it (``timeslice_weight_version``);
* ``--no-dev-mode`` answers 404 on the dev endpoints; ``--version`` < 0.17 has no ``/pause``.

Generation is simulated: ``max_tokens`` steps of ``--token-s`` seconds. ``GET /_standin/stats`` reports
completed/aborted counts (``cancelled``: requests stopped because their client closed the connection, as vLLM
aborts them). Run: ``timeslice-verl tenant standin --port 0`` (or ``python -m timeslice_verl.standin``); it prints
``listening on http://127.0.0.1:<port>`` once ready.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from timeslice_verl.standin.engine import Faults, StandinEngine, bad_request
from timeslice_verl.standin.weights import ROUTES as WEIGHT_ROUTES
from timeslice_verl.standin.weights import route as weight_route

CONTROL = ("pause", "resume", "sleep", "wake_up", "is_sleeping", "is_paused", "health")


def _get_routes(engine: StandinEngine) -> dict[str, Any]:
    """GET path → (status, body[, content type]) makers."""
    def metrics() -> tuple[int, str, str]:
        s, model = engine.stats(), engine.model
        return 200, (f'vllm:num_requests_running{{model_name="{model}"}} {float(s["running"])}\n'
                     f'vllm:num_requests_waiting{{model_name="{model}"}} {float(s["waiting"])}\n'
                     f'vllm:generation_tokens_total{{model_name="{model}"}} {float(s["generated"])}\n'
                     f'vllm:inter_token_latency_seconds_sum{{model_name="{model}"}} {float(s["itl_s"])}\n'
                     f'vllm:inter_token_latency_seconds_count{{model_name="{model}"}} {float(s["generated"])}\n'), \
            "text/plain"

    return {
        "/health": lambda: (200, {}),
        "/v1/models": lambda: (200, {"object": "list", "data": [{"id": engine.model, "object": "model"}]}),
        "/version": lambda: (200, {"version": engine.version}),
        "/metrics": metrics,
        "/is_sleeping": lambda: (200, {"is_sleeping": engine.stats()["sleeping"]}),
        "/is_paused": lambda: (200, {"is_paused": engine.stats()["paused"]}) if engine.has_pause else (404, {"detail": "Not Found"}),
        "/_standin/stats": lambda: (200, engine.stats()),
    }


def _post_control(engine: StandinEngine, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
    mode = query.get("mode", [None])[0]
    if path == "/pause" and engine.has_pause:
        engine.pause(mode or "abort", clear_cache=query.get("clear_cache", ["true"])[0].lower() != "false")
    elif path == "/resume" and engine.has_pause:
        engine.resume()
    elif path == "/sleep":
        engine.sleep((mode or "abort") if engine.has_pause else None)
    elif path == "/wake_up":
        with engine.cond:
            engine.wake_up_calls += 1
        if engine.fail_wake_up:  # a broken engine: every wake-up fails
            return 500, {"detail": "CUDA error: out of memory"}
        engine.wake()
    else:
        return 404, {"detail": "Not Found"}
    return 200, {}


DEV_PATHS = ("/is_sleeping", "/is_paused", "/pause", "/resume", "/sleep", "/wake_up", *WEIGHT_ROUTES)


class _Handler(BaseHTTPRequestHandler):
    """One request to the stand-in (``engine``, ``gets`` and ``server`` are set by :func:`make_handler`)."""

    engine: StandinEngine
    gets: dict[str, Any]
    server_owner: Any = None
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls
        if self.server_owner is not None:
            self.server_owner.connections.add(self.connection)

    def finish(self) -> None:
        super().finish()
        if self.server_owner is not None:
            self.server_owner.connections.discard(self.connection)

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (
            json.dumps(body, ensure_ascii=False) if content_type == "application/json" else str(body)).encode()  # as vLLM
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fault(self, path: str, query: dict[str, list[str]]) -> bool:
        """The injected faults; True when the call is answered (or never) by the fault itself."""
        f = self.engine.faults
        name, moded = Faults.names(path, query)
        if f.die_on and f.die_on in (name, moded):
            os._exit(3)
        if f.slow_s and (name in f.slow_on or moded in f.slow_on or (not f.slow_on and name in CONTROL)):
            time.sleep(f.slow_s)
        if f.hang and f.hang in (name, moded):
            time.sleep(3600)  # never answers
            return True
        for key in (moded, name):
            count, kind = f.fail.get(key, (0, ""))
            if count > 0:
                f.fail[key] = [count - 1, kind]
                if kind == "garbage":
                    self._send(200, b"<html>oops", "text/html")
                elif kind == "400":
                    self._send(400, bad_request("injected"))
                else:
                    self._send(500, {"detail": "injected"})
                return True
        return False

    def _route(self, path: str, query: dict[str, list[str]], post: bool) -> None:
        if path in DEV_PATHS:
            with self.engine.cond:
                self.engine.control_calls[path] = self.engine.control_calls.get(path, 0) + 1
        if self._fault(path, query):
            return
        if path in DEV_PATHS and not self.engine.dev_mode:
            self._send(404, {"detail": "Not Found"})
        elif not post and path in self.gets:
            self._send(*self.gets[path]())
        elif post and path in ("/v1/completions", "/v1/chat/completions"):
            self._complete(path)
        elif post and path in WEIGHT_ROUTES:
            self._weights(path)
        elif post and path == "/_standin/fault":
            body = self._json()
            self.engine.faults.update(body)
            if "late_on" in body:  # armed again: its next calls wait for the next /_standin/answer
                self.engine.late_answer.clear()
            self._send(200, {})
        elif post and path == "/_standin/answer":
            self.engine.late_answer.set()
            self._send(200, {})
        elif post and path == "/_standin/stop_listening" and self.server_owner is not None:
            self._send(200, {})
            threading.Thread(target=self.server_owner.stop_listening, daemon=True).start()
        elif post:
            answer = _post_control(self.engine, path, query)
            if self.engine.faults.late_on in Faults.names(path, query):  # in effect now, answered later
                self.engine.late_answer.wait()
            self._send(*answer)
        else:
            self._send(404, {"detail": "Not Found"})

    def _weights(self, path: str) -> None:
        try:
            body = self._json()
        except ValueError:
            self._send(400, {"detail": "Invalid JSON format"})
            return
        stats = self.engine.stats()
        self._send(*weight_route(self.engine.weights, path, body, generating=stats["running"],
                                 sleeping=stats["sleeping"]))

    def _json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        data = json.loads(self.rfile.read(length) or b"{}") if length else {}
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data

    def _complete(self, path: str) -> None:
        try:
            body = self._json()
            int(body.get("max_tokens", 16))
        except (ValueError, TypeError):
            self._send(400, {"object": "error", "message": "bad request", "type": "BadRequestError", "code": 400})
            return
        answer = self.engine.answer(path, body, self._client_gone)
        reason = answer[1].get("choices", [{}])[0].get("finish_reason")
        if reason == "cancelled":
            self.close_connection = True  # nobody to answer
            return
        if self.engine.faults.late_on in Faults.names(path, {}):  # generated, answered later
            self.engine.late_answer.wait()
        try:
            if self._client_gone():
                raise ConnectionResetError("the client went away before its answer")
            self._send(*answer)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            if reason in ("length", "stop"):
                self.engine.undelivered()  # generated, never answered: not a completed request

    def _client_gone(self) -> bool:
        """The client closed the connection while its request runs (nothing else is read on it meanwhile): vLLM
        aborts such a request, so the stand-in stops it too."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def do_GET(self) -> None:
        url = urlparse(self.path)
        self._route(url.path, parse_qs(url.query), post=False)

    def do_POST(self) -> None:
        url = urlparse(self.path)
        self._route(url.path, parse_qs(url.query), post=True)


def make_handler(engine: StandinEngine, server: StandinServer | None = None) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"engine": engine, "gets": _get_routes(engine), "server_owner": server})


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # vLLM's listen backlog is large: hundreds of clients connect at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):  # a client that went away
            super().handle_error(request, client_address)


class _V6Server(_Server):
    address_family = socket.AF_INET6


class StandinServer:
    """In-process server (a thread) — for the demo's dry run and quick tests."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any) -> None:
        self.engine = StandinEngine(**engine_kwargs)
        server_cls = _V6Server if ":" in host else _Server
        self.httpd = server_cls((host, port), make_handler(self.engine, self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="standin-vllm", daemon=True)
        self.listening = True
        self.connections: set[socket.socket] = set()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> StandinServer:
        self.thread.start()
        return self

    def stop_listening(self) -> None:
        """Close the listening socket (the API server is gone; the process and its "GPU memory" live on)."""
        self.listening = False
        self.httpd.shutdown()
        self.httpd.server_close()
        for conn in list(self.connections):  # kept-alive connections end too: clients meet whoever listens now
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        if self.listening:
            self.stop_listening()


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="timeslice-verl tenant standin", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--version", default="0.24.0", dest="vllm_version")
    ap.add_argument("--model", default="m", help="the served model's name")
    ap.add_argument("--no-dev-mode", action="store_true")
    ap.add_argument("--sleep-in-flight", choices=("crash", "abort"), default="crash")
    ap.add_argument("--token-s", type=float, default=0.01)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="at most this many requests run; the rest wait (0: any)")
    ap.add_argument("--knee", type=int, default=0,
                    help="past this many running, a step slows in proportion (the server's tokens/s stop growing)")
    ap.add_argument("--fail-wake-up", action="store_true", help="answer every /wake_up with 500 (a broken engine)")
    ap.add_argument("--hang", default="", help="an endpoint that never answers, e.g. wake_up, health, pause or pause:keep")
    ap.add_argument("--slow-s", type=float, default=0.0, help="answer control calls this many seconds late")
    ap.add_argument("--slow-on", action="append", default=[], help="only this endpoint is slow (repeatable)")
    ap.add_argument("--fail", action="append", default=[], metavar="ENDPOINT:COUNT[:500|400|garbage]",
                    help="the next COUNT calls of ENDPOINT answer HTTP 500, vLLM's 400, or a body that is not JSON "
                         "(repeatable)")
    ap.add_argument("--die-on", default="", help="exit at once when this endpoint is called, e.g. pause")
    ap.add_argument("--engine-child", action="store_true",
                    help="start a child process without the TIMESLICE_TENANT tag, as vLLM starts its engine core")
    ap.add_argument("--asleep", action="store_true", help="start paused and asleep (as an agent left it)")
    ap.add_argument("--enable-sleep-mode", action="store_true", help="accepted as vLLM takes it (the stand-in always can)")
    return ap.parse_args(argv)


def _fail_spec(items: list[str]) -> dict[str, list]:
    out = {}
    for item in items:
        parts = item.split(":")
        kind = parts.pop() if parts[-1] in ("500", "400", "garbage") else "500"
        count = int(parts.pop())
        out[":".join(parts)] = [count, kind]
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    faults = Faults(hang=a.hang, slow_s=a.slow_s, slow_on=a.slow_on, fail=_fail_spec(a.fail), die_on=a.die_on)
    try:
        server = StandinServer(a.host, a.port, version=a.vllm_version, dev_mode=not a.no_dev_mode, model=a.model,
                                sleep_in_flight=a.sleep_in_flight, token_s=a.token_s, fail_wake_up=a.fail_wake_up,
                                faults=faults, max_num_seqs=a.max_num_seqs, knee=a.knee)
    except OSError as exc:  # the port is taken, the address is not this machine's: one line, as a server says it
        raise SystemExit(f"stand-in vLLM: cannot listen on {a.host}:{a.port}: {exc.strerror or exc}; give another "
                         "--port (or stop what holds this one)") from None
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
        while not server.listening:  # the listener was closed on purpose: the process lives on
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    return 0

