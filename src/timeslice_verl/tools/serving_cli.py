"""``timeslice-verl batch …`` and ``timeslice-verl tenant run``: the node's batch service, its clients, and the tenant
under its supervisor."""

from __future__ import annotations

import functools
import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import click

from timeslice_verl.config.schema import ConfigError, TimesliceSettings, socket_path
from timeslice_verl.log import get_logger

log = get_logger("batch")


def _settings(overrides: tuple[str, ...]) -> TimesliceSettings:
    from timeslice_verl.config.overrides import compose

    bad = [o for o in overrides if not o.startswith("timeslice.") or "=" not in o]
    if bad:
        raise click.UsageError(f"--set takes timeslice.KEY=VALUE, not {', '.join(map(repr, bad))}")
    try:
        return compose("interleave", list(overrides))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


SET_OPTION = click.option("--set", "overrides", multiple=True, metavar="timeslice.KEY=VALUE",
                          help="A setting (repeatable), e.g. --set timeslice.batch.port=8091.")


def SET(f: Callable[..., Any]) -> Callable[..., Any]:
    """Settings as every command takes them: bare ``timeslice.KEY=VALUE`` arguments (as ``agent`` and ``status``) or
    ``--set timeslice.KEY=VALUE``."""
    @functools.wraps(f)
    def wrapper(*args: Any, overrides: tuple[str, ...] = (), settings: tuple[str, ...] = (), **kw: Any) -> Any:
        return f(*args, overrides=(*settings, *overrides), **kw)

    return click.argument("settings", nargs=-1, metavar="[timeslice.KEY=VALUE]...")(SET_OPTION(wrapper))


URL = click.option("--url", default="", help="The batch service (default: http://timeslice.batch.host:port).")


KEY = click.option("--api-key", default="", metavar="KEY", help="The service's key (default: TIMESLICE_BATCH_API_KEY, "
                   "else the file timeslice.batch.key_file the service made).")


def _client(url: str, overrides: tuple[str, ...], api_key: str = ""):
    from timeslice_verl.batch.auth import NoKey, client_key
    from timeslice_verl.batch.client import BatchClient

    b = _settings(overrides).batch
    try:
        key = client_key(b.key_file, api_key)
    except NoKey as exc:
        raise click.ClickException(str(exc)) from None
    host = f"[{b.host}]" if ":" in b.host else b.host
    return BatchClient(url or f"http://{host}:{b.port}", key)


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@click.group("batch")
def batch_group() -> None:
    """The node's batch service: OpenAI-compatible batches fed to the tenant while it has the GPU."""


@batch_group.command("serve")
@click.option("--api-only", is_flag=True, help="The API alone, feeding no tenant: a replica of a cluster's (timeslice.batch."
              "store=postgresql), beside a `batch feed` on every node.")
@SET
def serve_cmd(api_only: bool, overrides: tuple[str, ...]) -> None:
    """Run the batch service (foreground; SIGTERM or Ctrl-C to stop). Needs the 'batch' extra."""
    _run_service(overrides, "api" if api_only else "all")


@batch_group.command("feed")
@SET
def feed_cmd(overrides: tuple[str, ...]) -> None:
    """Feed this node's tenants from the cluster's queue (timeslice.batch.store=postgresql), gated by the node's agent;
    serves /health and /metrics only. Needs the 'batch' extra."""
    _run_service(overrides, "feed")


def _run_service(overrides: tuple[str, ...], role: str) -> None:
    try:
        from timeslice_verl.batch.service import Role, serve
    except ImportError as exc:
        raise click.ClickException(f"the batch service needs the 'batch' extra: pip install 'timeslice-verl[batch]' ({exc})")
    settings = _settings(overrides)
    if role != "all" and str(settings.batch.store) != "postgresql":
        log.warning("batch %s over SQLite: only processes of this node share %s", role, settings.batch.db or "the default file")
    try:
        serve(settings, Role(role))
    except (ValueError, RuntimeError, OSError) as exc:
        raise _fail(exc) from None


@batch_group.command("submit")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", default="", help="Default: the url of the file's first request.")
@click.option("--no-wait", is_flag=True, help="Print the batch id and return.")
@click.option("--completion-window", "window", default="24h", show_default=True,
              help="Its deadline: OpenAI's 24h or shorter ('1h', '4h', '90m'); earliest deadline first within a "
                   "priority, and past it the batch ends expired with what was answered.")
@URL
@KEY
@SET
def submit_cmd(path: Path, endpoint: str, no_wait: bool, window: str, url: str, api_key: str,
               overrides: tuple[str, ...]) -> None:
    """Upload a JSONL file of requests and create a batch; then show its progress (lines done, rate, ETA)."""
    from timeslice_verl.batch.client import BatchClientError, describe, endpoint_of, follow, not_sent

    client = _client(url, overrides, api_key)
    try:
        batch = client.create(client.upload(path)["id"], endpoint or endpoint_of(path), window=window)
        click.echo(batch["id"])
        if not no_wait:
            batch = follow(client, batch, echo=click.echo)
            click.echo(describe(batch, not_sent(client, batch)))
    except BatchClientError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        click.echo(f"stopped following {batch['id']}: it goes on (timeslice-verl batch status {batch['id']})", err=True)


@batch_group.command("status")
@click.argument("batch_id", required=False)
@click.option("--json", "as_json", is_flag=True)
@URL
@KEY
@SET
def status_cmd(batch_id: str | None, as_json: bool, url: str, api_key: str, overrides: tuple[str, ...]) -> None:
    """One batch, or the latest ones."""
    from timeslice_verl.batch.client import BatchClientError, describe, not_sent

    if batch_id and batch_id.startswith("timeslice.") and "=" in batch_id:  # a setting, not a batch
        batch_id, overrides = None, (batch_id, *overrides)
    client = _client(url, overrides, api_key)
    try:
        batches = [client.get(batch_id)] if batch_id else client.list()
        shown = "\n".join(describe(b, not_sent(client, b)) for b in batches) if not as_json else ""
    except BatchClientError as exc:
        raise _fail(exc) from None
    click.echo(json.dumps(batches, indent=1) if as_json else shown or "no batch")


@batch_group.command("results")
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where the answers go (default: BATCH_ID.jsonl here).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the error file (default: OUTPUT with .errors.jsonl).")
@URL
@KEY
@SET
def results_cmd(batch_id: str, output: Path | None, errors: Path | None, url: str, api_key: str, overrides: tuple[str, ...]) -> None:
    """Download a batch's output (and error) file."""
    from timeslice_verl.batch.client import BatchClientError

    client = _client(url, overrides, api_key)
    output = output or Path(f"{batch_id}.jsonl")
    try:
        batch = client.get(batch_id)
        if batch["status"] not in ("completed", "cancelled", "expired", "failed"):
            raise click.ClickException(f"batch {batch_id} is {batch['status']}: its files are made once it ends")
        n = client.download(batch["output_file_id"], output) if batch.get("output_file_id") else 0
        click.echo(f"{n} answer(s) in {output}")
        if batch.get("error_file_id"):
            errors = errors or output.with_suffix(".errors.jsonl")
            click.echo(f"{client.download(batch['error_file_id'], errors)} error(s) in {errors}")
    except BatchClientError as exc:
        raise _fail(exc) from None


@batch_group.command("cancel")
@click.argument("batch_id")
@URL
@KEY
@SET
def cancel_cmd(batch_id: str, url: str, api_key: str, overrides: tuple[str, ...]) -> None:
    """Cancel a batch: what was not sent yet goes to its error file as cancelled."""
    from timeslice_verl.batch.client import BatchClientError, describe, not_sent

    try:
        client = _client(url, overrides, api_key)
        batch = client.cancel(batch_id)
        click.echo(describe(batch, not_sent(client, batch)))
    except BatchClientError as exc:
        raise _fail(exc) from None


@batch_group.command("key")
@SET
def key_cmd(overrides: tuple[str, ...]) -> None:
    """Print the service's API key (for the OpenAI client: OPENAI_API_KEY=$(timeslice-verl batch key))."""
    from timeslice_verl.batch.auth import NoKey, client_key

    try:
        click.echo(client_key(_settings(overrides).batch.key_file))
    except NoKey as exc:
        raise click.ClickException(str(exc)) from None


@click.group("tenant")
def tenant_group() -> None:
    """The node's tenant (vLLM) under a supervisor."""


@tenant_group.command("standin", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def standin_cmd(args: tuple[str, ...]) -> None:
    """A stand-in vLLM on the CPU (no GPU, no model) for trying the agent, the supervisor and the batch service:
    vLLM's endpoints, simulated generation. Never a real tenant. Its options: timeslice-verl tenant standin --help."""
    from timeslice_verl.standin.server import main as standin

    sys.exit(standin(list(args)))


@tenant_group.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--gpu", default="", help="'auto' (the GPU the agent sees the trainer on), an index or a UUID.")
@click.option("--max-restarts", default=0, show_default=True, help="Give up after this many restarts (0: never).")
@click.option("--backoff-max-s", default=60.0, show_default=True)
@click.option("--start-timeout-s", default=1800.0, show_default=True,
              help="A server that does not answer /health this long after its start is stopped and started again.")
@click.option("--no-wait-for-memory", is_flag=True, help="Start at once, even if the GPU has less free than vLLM asks.")
@click.option("--register-url", default="", metavar="URL",
              help="The URL the agent reaches the server at (Kubernetes: the node-local Service); default: its own.")
@SET_OPTION
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def tenant_run(gpu: str, max_restarts: int, backoff_max_s: float, start_timeout_s: float, no_wait_for_memory: bool, register_url: str,
               overrides: tuple[str, ...], command: tuple[str, ...]) -> None:
    """Start the tenant (after --: vllm serve MODEL …) and bring it back when it dies; the agent takes it back."""
    from timeslice_verl.supervisor.supervisor import Supervisor, TenantCommand

    lead = 0
    while lead < len(command) and command[lead].startswith("timeslice.") and "=" in command[lead]:
        lead += 1  # bare settings before the server's command, as every other command takes them
    overrides, command = (*command[:lead], *overrides), command[lead:]
    try:
        cmd = TenantCommand.parse(list(command))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if shutil.which(cmd.argv[0]) is None:  # checked here: the supervisor would start it again and again
        vllm = "install vLLM in this environment (pip install vllm) or " if "vllm" in cmd.argv[0] else ""
        raise click.ClickException(f"tenant run: the server's command {cmd.argv[0]!r} is not found (not on PATH, or "
                                   f"not an executable file): {vllm}give its full path after --")
    if max_restarts < 0 or not 0 < backoff_max_s <= 86400 or not 0 < start_timeout_s <= 86400:
        raise click.UsageError("--max-restarts must be >= 0; --backoff-max-s and --start-timeout-s in (0, 86400]")
    if register_url and not register_url.startswith(("http://", "https://")):
        raise click.UsageError(f"--register-url {register_url!r} is not an http(s) URL")
    sock = socket_path(_settings(overrides))
    sup = Supervisor(cmd, agent_socket=str(sock), gpu=gpu, max_restarts=max_restarts, backoff_max_s=backoff_max_s,
                     start_timeout_s=start_timeout_s, wait_for_memory=not no_wait_for_memory, register_url=register_url,
                     lock_path=sock.parent / f"tenant-{cmd.port}.lock")
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    sys.exit(sup.run())


__all__ = ["batch_group", "tenant_group"]
