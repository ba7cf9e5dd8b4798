"""What a new user meets following the README: each command that cannot do its work says why in one line and what to
do, exits non-zero and leaves nothing running; what a run wrote is never deleted by the next one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent_support import eventually, terminate

CLI = [sys.executable, "-m", "timeslice_verl"]
BLOCKER = """import sys


class _Blocked:
    \"\"\"These modules are not installed, as far as this process can tell.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
"""


def without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment whose Python cannot import ``modules`` (a ``sitecustomize`` on PYTHONPATH blocks them)."""
    site = tmp_path / "blocked-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(names=set(modules)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def processes_naming(text: str) -> list[int]:
    """This machine's processes whose command line names ``text`` (a test's own folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


# --------------------------------------------------------------------------- the demo


@pytest.mark.parametrize("blocked", [("verl",), ("verl", "torch", "pandas", "pyarrow")])
def test_demo_validation_without_the_verl_extra_says_what_to_install_and_starts_nothing(tmp_path, blocked):
    out = tmp_path / "demo"
    proc = subprocess.run([*CLI, "demo", "--out", str(out), "--steps", "2", "--rollout-s", "0.2", "--train-s", "0.05",
                           "--device", "cpu", "--validate-every", "2"], capture_output=True, text=True, timeout=300,
                          env=without(tmp_path, *blocked))
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_error_line(proc.stderr)
    assert "'verl' extra" in line and "pip install '.[verl]'" in line and f"missing: {', '.join(blocked)}" in line
    assert not (out / "agent.log").exists() and processes_naming(str(out)) == []


def test_a_second_demo_in_the_same_folder_moves_the_first_run_aside_whole(tmp_path):
    """The run a folder held is moved into ``earlier/<when it ended>/`` (its timeline, summary, picture), never deleted."""
    out = tmp_path / "demo"
    args = [*CLI, "demo", "--out", str(out), "--steps", "1", "--rollout-s", "0.1", "--train-s", "0.05", "--device", "cpu",
            "--solo"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    kept = {name: (out / name).read_bytes() for name in ("run.jsonl", "summary.json", "timeline.png")}
    second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    (earlier,) = (out / "earlier").iterdir()
    assert {name: (earlier / name).read_bytes() for name in kept} == kept
    assert f"earlier    {earlier}" in second.stdout and "earlier" not in first.stdout
    assert json.loads((out / "run.jsonl").read_text().splitlines()[0])  # this run's own timeline, beside it


@pytest.mark.slow
def test_demo_step_lines_name_their_figures_in_words_and_units(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([*CLI, "demo", "--out", str(out), "--steps", "2", "--rollout-s", "0.3", "--train-s", "0.05",
                           "--device", "cpu", "--batch-lines", "40", "--finish-batch-s", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [line.split("timeslice.demo: ", 1)[1] for line in proc.stderr.splitlines() if "timeslice.demo: step " in line]
    assert len(steps) == 2 and all("{" not in line and "timeslice/" not in line for line in steps), steps
    assert all(" s (waited " in line and " · handoffs " in line and " · thaw " in line and " ms" in line
               for line in steps), steps


# --------------------------------------------------------------------------- the tenant


def test_tenant_run_of_a_command_that_is_not_installed_says_so_and_leaves_nothing(tmp_path):
    bare = tmp_path / "bin"  # a PATH without vLLM on it
    bare.mkdir()
    proc = subprocess.run([*CLI, "tenant", "run", "--set", f"timeslice.agent.socket={tmp_path}/agent.sock", "--",
                           "vllm", "serve", "some/model", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PATH=str(bare)))
    assert proc.returncode != 0
    line = one_error_line(proc.stderr)
    assert "'vllm' is not found" in line and "pip install vllm" in line and "full path" in line, line
    assert processes_naming(str(tmp_path)) == []


def test_the_supervisor_gives_up_on_a_command_it_cannot_start(tmp_path):
    """Not executable (or gone between two starts): no restart would bring it, so the supervisor ends (2)."""
    from timeslice_verl.supervisor.supervisor import Supervisor, TenantCommand

    script = tmp_path / "server"
    script.write_text("#!/bin/sh\n")  # not executable
    sup = Supervisor(TenantCommand.parse([str(script), "--port", str(free_port())]), wait_for_memory=False)
    assert sup.run() == 2 and sup.restarts == 0


def test_tenant_standin_on_a_port_in_use_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*CLI, "tenant", "standin", "--port", str(port)], capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    line = one_error_line(proc.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line and "another --port" in line, line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the batch service


def test_batch_submit_with_no_agent_on_the_node_says_why_no_line_moves(tmp_path, procs, vllm):
    pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")
    from batch_support import BatchServiceProc, write_requests

    service = BatchServiceProc(tmp_path / "service", vllm.url, agent_socket=tmp_path / "no-agent.sock").start()
    procs.append(service)
    write_requests(tmp_path / "in.jsonl", 3)
    shown = tmp_path / "submit.out"
    with shown.open("w") as out:
        submit = subprocess.Popen([*CLI, "batch", "submit", str(tmp_path / "in.jsonl"), "--url", service.url,
                                   "--api-key", service.key], stdout=out, stderr=subprocess.DEVNULL)
    try:
        said = eventually(lambda: next((line for line in shown.read_text().splitlines() if "agent" in line), None),
                          what="submit says why nothing moves")
        assert said.startswith("no agent answers on this node") and "`timeslice-verl agent`" in said, said
        submit.send_signal(signal.SIGINT)
        assert submit.wait(60) == 0  # it stopped following; the batch goes on
        assert shown.read_text().count("no agent answers") == 1, "said once, not at every poll"
    finally:
        terminate(submit)


@pytest.mark.parametrize("engine", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_service_on_a_fresh_database_logs_one_line_for_its_schema(tmp_path, procs, engine):
    pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")
    from batch_support import BatchServiceProc

    env, extra = {}, ()
    if engine == "postgresql":
        from pg_support import Postgres, need_postgres

        need_postgres()
        server = Postgres().start()
        procs.append(type("Server", (), {"stop": staticmethod(server.close)})())
        env = {"TIMESLICE_BATCH_DSN": server.database(f"fresh_{os.getpid()}"), "TIMESLICE_BATCH_API_KEY": "k" * 32}
        extra = ("timeslice.batch.store=postgresql",)
    service = BatchServiceProc(tmp_path, "", command=("serve", "--api-only"), env=env, extra=extra).start()
    procs.append(service)
    service.stop()
    said = [line for line in service.log().splitlines() if "schema" in line]
    from timeslice_verl.batch.schema import SCHEMA_VERSION

    assert len(said) == 1 and said[0].endswith(f": created schema v{SCHEMA_VERSION}"), said


# --------------------------------------------------------------------------- doctor, status


def test_doctor_fails_the_cuda_backend_where_libcuda_cannot_be_loaded(tmp_path):
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda.so.1 loads on this machine")
    except OSError:
        pass
    proc = subprocess.run([*CLI, "doctor", f"timeslice.agent.socket={tmp_path}/nope.sock", "timeslice.agent.backend=cuda",
                           "timeslice.tenant.url=http://127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    line = next(line for line in proc.stdout.splitlines() if "agent backend frees GPU memory" in line)
    assert line.startswith("FAIL") and "libcuda.so.1" in line, line
    assert proc.returncode == 1


def test_status_names_its_two_in_flight_figures_apart_and_says_why_lines_are_held():
    """Lines a feeder claimed and requests open at the tenant differ (claimed lines wait for a seat): two names."""
    from timeslice_verl.tools.status import render_batch

    text = render_batch({"tenant": "http://t", "gate": {"open": False, "source": "agent", "why": "the GPU's owner: job:a"},
                         "lines": {"queued": 5, "inflight": 3, "done": 90, "retried": 0, "failed": 0},
                         "tenants": [{"tenant": "http://t", "limit": 256, "inflight": 2, "sent": 92, "answered": 90}]})
    assert "in flight" not in text, text
    assert "claimed by a feeder 3" in text and "2 requests open at the tenant" in text
    assert "holding (following the agent: the GPU's owner: job:a)" in text


def test_batch_status_shows_lines_a_cancel_ended_apart_from_failed_ones(tmp_path, procs, vllm):
    pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")
    from click.testing import CliRunner

    from batch_support import BatchServiceProc, create_batch, write_requests
    from timeslice_verl.tools.cli import main

    # no agent answers: the gate holds every line, so a cancel ends all of them unsent
    service = BatchServiceProc(tmp_path / "service", vllm.url, agent_socket=tmp_path / "no-agent.sock").start()
    procs.append(service)
    write_requests(tmp_path / "in.jsonl", 3)
    with service.http() as http:
        bid = create_batch(http, tmp_path / "in.jsonl")
        http.post(f"/v1/batches/{bid}/cancel").raise_for_status()
        eventually(lambda: http.get(f"/v1/batches/{bid}").json()["status"] == "cancelled", what="the batch cancelled")
    shown = CliRunner().invoke(main, ["batch", "status", bid, "--url", service.url, "--api-key", service.key])
    assert shown.exit_code == 0, shown.output
    assert "0/3 done, 0 failed, 3 not sent (cancelled)" in shown.output, shown.output


def test_the_stand_in_counts_a_request_whose_client_left_before_its_answer_as_cancelled_not_completed():
    """Its ``completed`` counts answered requests: a line the batch service gave up on (and sent again) is not one."""
    import httpx

    from timeslice_verl.standin.server import StandinServer

    server = StandinServer(token_s=0.001).start()
    try:
        httpx.post(f"{server.url}/_standin/fault", json={"late_on": "v1/completions"}).raise_for_status()
        host, port = server.httpd.server_address[:2]
        body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 3}).encode()
        client = socket.create_connection((host, port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        stats = lambda: httpx.get(f"{server.url}/_standin/stats").json()  # noqa: E731
        eventually(lambda: stats()["generated"] == 3 and stats()["running"] == 0, what="the request generated")
        client.close()  # the client leaves before the answer
        httpx.post(f"{server.url}/_standin/answer").raise_for_status()
        eventually(lambda: stats()["cancelled"] == 1, what="the request counted as cancelled")
        assert stats()["completed"] == 0
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "q", "max_tokens": 1}).is_success
        assert stats()["completed"] == 1
    finally:
        server.stop()


