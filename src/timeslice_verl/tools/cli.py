"""``timeslice-verl``: the command line."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click

from timeslice_verl import __version__
from timeslice_verl.config.schema import ConfigError
from timeslice_verl.config.overrides import compose, options
from timeslice_verl.demo.arrivals import PROFILES

PROFILE_NAMES = tuple(PROFILES)
from timeslice_verl.log import setup_cli_logging


def _settings_from(option: str, overrides: tuple[str, ...]):
    try:
        return compose(option, list(overrides))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="timeslice-verl")
@click.option("--log-level", default="INFO", show_default=True, help="Level of the 'timeslice' logger.",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False))
def main(log_level: str) -> None:
    """Lend the idle GPU of a verl fully-async trainer to a co-resident vLLM server."""
    setup_cli_logging(log_level.upper())


@main.command("config")
@click.option("--option", "option", default=None, help="Option of the timeslice group (default: interleave; "
              "or +timeslice=NAME among the overrides).")
@click.option("--json", "as_json", is_flag=True, help="Print the section as JSON instead.")
@click.argument("overrides", nargs=-1)
def config_cmd(option: str | None, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Print the validated timeslice section, every key, in the trainer's own override syntax: the
    option (+timeslice=NAME) plus timeslice.KEY=VALUE overrides. What verl would refuse is refused."""
    from timeslice_verl.config.overrides import picks_option, to_overrides

    if option is not None and any(picks_option(o) for o in overrides):
        raise click.UsageError("timeslice: the option is given twice (--option and +timeslice=…); give one")
    settings = _settings_from(option or "interleave", overrides)
    if as_json:
        click.echo(json.dumps({"timeslice": dataclasses.asdict(settings)}, indent=2, default=str))
        return
    chosen = next((o.partition("=")[2] for o in overrides if picks_option(o)), option or "interleave")
    click.echo(f"+timeslice={chosen}")
    for line in to_overrides(settings, sections=None):
        click.echo(line)


@main.command("hooks")
@click.option("--markdown", is_flag=True, help="Print the hook reference as Markdown.")
def hooks_cmd(markdown: bool) -> None:
    """List the lifecycle hooks plugins can implement."""
    from timeslice_verl.hooks.reference import hook_reference_markdown, hook_summaries

    if markdown:
        click.echo(hook_reference_markdown(), nl=False)
        return
    for name, kind, summary in hook_summaries():
        click.echo(f"{name:24} {kind:9} {summary}")


@main.command("plugins")
@click.option("--option", "option", default="interleave", show_default=True)
@click.argument("overrides", nargs=-1)
def plugins_cmd(option: str, overrides: tuple[str, ...]) -> None:
    """Load the plugins the config asks for and list them with their hooks."""
    from timeslice_verl.hooks.manager import PluginLoadError, TimesliceManager

    settings = _settings_from(option, overrides)
    try:
        manager = TimesliceManager().load(settings.plugins)
    except PluginLoadError as exc:
        raise click.ClickException(str(exc)) from None
    for info in manager.plugins():
        click.echo(f"{info.name:20} {info.source:36} {', '.join(info.hooks)}")
    for name in manager.disabled():
        click.echo(f"{name:20} {'disabled (timeslice.plugins.disabled)':36}")


@main.command("agent", context_settings={"ignore_unknown_options": True})
@click.option("--option", "option", default="interleave", show_default=True, help="Option of the timeslice group.")
@click.option("--doctor-first", is_flag=True, help="Check what the agent needs from its container (host PID "
              "namespace, socket directory, NVML, driver) and refuse to start, saying what is missing.")
@click.argument("overrides", nargs=-1)
def agent_cmd(option: str, doctor_first: bool, overrides: tuple[str, ...]) -> None:
    """Run the node's snapshot agent in the foreground (stop with SIGTERM or Ctrl-C).

    Takes the same dotted overrides as the trainer, e.g.
    timeslice-verl agent timeslice.tenant.url=http://127.0.0.1:8000 timeslice.agent.gpus=[0]
    """
    import asyncio

    from timeslice_verl.agent.server import AgentStartError, run_agent

    settings = _settings_from(option, overrides)
    if doctor_first:
        from timeslice_verl.tools.container import container_checks
        from timeslice_verl.tools.doctor import render

        checks = container_checks(settings)
        click.echo(render(checks), err=True)
        if not all(c.ok for c in checks):
            raise click.ClickException("the agent's container lacks what it needs (FAIL lines above); not starting")
    try:
        asyncio.run(run_agent(settings))
    except AgentStartError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # bad GPU index and the like, named by key
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # a port or path the agent cannot take
        raise click.ClickException(f"the agent could not start: {exc}") from None


@main.command("status", context_settings={"ignore_unknown_options": True})
@click.option("--option", "option", default="interleave", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the agent's raw status as JSON.")
@click.argument("overrides", nargs=-1)
def status_cmd(option: str, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Show who owns the GPU, the jobs, the tenant and the queue, as the agent sees them."""
    from timeslice_verl.agent.client import AgentClient, AgentError
    from timeslice_verl.config.schema import socket_path
    from timeslice_verl.tools.status import render_status

    settings = _settings_from(option, overrides)
    try:
        with AgentClient(socket_path(settings), connect_timeout_s=2.0, client="cli") as client:
            status = client.status()
    except AgentError as exc:
        raise click.ClickException(str(exc)) from None
    batch = _batch_summary(settings)
    if as_json:
        click.echo(json.dumps({**status, **({"batch": batch} if batch else {})}, indent=2))
        return
    click.echo(render_status(status))
    if batch:
        from timeslice_verl.tools.status import render_batch

        click.echo(render_batch(batch))


def _batch_summary(settings: Any) -> dict[str, Any] | None:
    """The node's batch service's summary, if one answers at timeslice.batch.host:port."""
    import httpx

    from timeslice_verl.batch.auth import NoKey, client_key, key_file

    host = f"[{settings.batch.host}]" if ":" in settings.batch.host else settings.batch.host
    try:
        key = client_key(settings.batch.key_file)
    except NoKey as exc:
        key, why = "", str(exc)
    try:
        resp = httpx.get(f"http://{host}:{settings.batch.port}/timeslice/summary", timeout=2,
                         headers={"Authorization": f"Bearer {key}"} if key else {})
    except httpx.HTTPError:
        return None
    if resp.status_code == 401:
        return {"error": why if not key else f"the service refused the key in {key_file(settings.batch.key_file)}"}
    try:
        return {**resp.json(), "key_file": str(key_file(settings.batch.key_file))} if resp.is_success else None
    except ValueError:
        return None


@main.command("doctor", context_settings={"ignore_unknown_options": True})
@click.option("--option", "option", default="interleave", show_default=True)
@click.option("--container", is_flag=True, help="Only what the agent needs from its container (Kubernetes pod).")
@click.argument("overrides", nargs=-1)
def doctor_cmd(option: str, container: bool, overrides: tuple[str, ...]) -> None:
    """Check this node: driver, NVML, NCCL env, vLLM, agent, host RAM. Exits 1 on any FAIL."""
    from timeslice_verl.tools.doctor import render, run_checks

    settings = _settings_from(option, overrides)
    if container:
        from timeslice_verl.tools.container import container_checks

        checks = container_checks(settings)
    else:
        checks = run_checks(settings)
    click.echo(render(checks))
    if not all(c.ok for c in checks):
        sys.exit(1)


@main.group("timeline")
def timeline_group() -> None:
    """Look at a timeline recorded by the timeline plugin."""


@timeline_group.command("plot")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="PNG to write (default: PATH with .png).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the summary as JSON.")
def timeline_plot(path: str, output: str | None, json_out: str | None) -> None:
    """Draw GPU ownership over time from PATH (JSONL) and print the summary."""
    from pathlib import Path

    from timeslice_verl import analysis

    try:
        records = analysis.load(path)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    out = Path(output) if output else Path(path).with_suffix(".png")
    analysis.plot(records, out)
    summary = analysis.summary(records)
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=1))
    click.echo(analysis.render_summary(summary))
    click.echo(f"wrote {out}")


@main.command("demo")
@click.option("--out", type=click.Path(file_okay=False), default="timeslice-demo", show_default=True)
@click.option("--steps", default=8, show_default=True, help="Training steps.")
@click.option("--rollout-s", default=1.5, show_default=True, help="Seconds the rollout takes per batch (the trainer waits "
              "for what training did not cover).")
@click.option("--train-s", default=0.5, show_default=True, help="Seconds of GPU work per step.")
@click.option("--profile", type=click.Choice(["even", *PROFILE_NAMES]), default="even", show_default=True,
              help="How samples arrive: evenly over each batch, or shaped like verl's rollouter (fleet, longtail).")
@click.option("--required", default=0, help="Samples per step (default: 16 even, 32 with a profile).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--gib", default=8.0, show_default=True, help="GPU memory the trainer worker holds (cuda).")
@click.option("--vllm-url", default="", help="A running vLLM (VLLM_SERVER_DEV_MODE=1, --enable-sleep-mode).")
@click.option("--vllm-model", default="", help="Start vLLM on this model (under timeslice-verl tenant run) instead.")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="ARG",
              help="An argument for the vLLM --vllm-model starts, e.g. --vllm-arg=--max-model-len=2048 (repeatable).")
@click.option("--clients", default=4, show_default=True, help="Batch requests kept in flight at the tenant.")
@click.option("--batch-lines", default=0, help="Lines of the batch submitted at the start (default: 20 000 on a GPU; "
              "1 000 dry, about what the valleys answer, the rest finished after the last step).")
@click.option("--max-tokens", default=0, help="Tokens per batch line (default: 48 on a GPU, 24 dry).")
@click.option("--finish-batch-s", default=-1.0, help="After the last step, let the batch complete for up to this many "
              "seconds before what is left is cancelled (default: 0 on a GPU, 120 dry).")
@click.option("--burst-every", default=0, show_default=True,
              help="Every k-th batch comes 20x faster (already queued at the release: a skipped handoff); 0: none.")
@click.option("--wedge-at", default=0, help="Stop the tenant (SIGSTOP) in this step's valley: the ladder kills it and "
              "its supervisor brings it back.")
@click.option("--validate-every", default=0, help="Validate every this many versions in the valleys: the trainer's "
              "weights pushed into a policy tenant beside the batch tenant (needs the 'verl' extra); 0: off.")
@click.option("--policy-url", default="", help="The policy tenant: a running vLLM with --weight-transfer-config "
              "(default: a stand-in under tenant run).")
@click.option("--policy-model", default="", help="The Hugging Face model the trainer holds and pushes: the one "
              "--policy-url serves (GPU; default: a small CPU module).")
@click.option("--solo", is_flag=True, help="The same schedule with +timeslice=observe: no agent, no tenant (the baseline).")
@click.option("--set", "overrides", multiple=True, metavar="timeslice.KEY=VALUE",
              help="A setting of the interleave section, e.g. --set timeslice.handoff.swap=checkpoint (repeatable).")
def demo_cmd(out: str, overrides: tuple[str, ...], **kw: Any) -> None:
    """Run the whole chain on this machine and draw the timeline (a dry run without a GPU)."""
    from pathlib import Path

    from timeslice_verl.demo.run import DemoOptions, gpu_available, run_demo

    _check_demo(kw, overrides)
    if kw["device"] == "cuda" and not gpu_available():
        raise click.UsageError("--device cuda needs an NVIDIA GPU and torch with CUDA; none here "
                               "(leave --device at auto for the labelled dry run)")
    opts = DemoOptions(out=Path(out), overrides=overrides, **kw)
    import signal

    def stop(signum: int, frame: object) -> None:  # SIGTERM unwinds like Ctrl-C: the agent, worker, tenant go too
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        summary = run_demo(opts)
    except ConfigError as exc:  # a --set the schema refuses: the overrides' own message, no traceback
        raise click.UsageError(str(exc)) from None
    except RuntimeError as exc:  # a part that did not start (the tenant, the batch service): its log is named
        raise click.ClickException(str(exc)) from None
    except ImportError as exc:  # what the checks above did not foresee: everything started is stopped by now
        raise click.ClickException(f"the demo needs {exc.name or exc}, which is not installed here: pip install "
                                   "'.[verl]' in a clone of timeslice-verl") from None
    _echo_demo(summary, kw["solo"])


def _check_demo(kw: dict[str, Any], overrides: tuple[str, ...]) -> None:
    if kw["steps"] < 1 or kw["rollout_s"] < 0 or kw["train_s"] < 0 or kw["gib"] <= 0 or kw["clients"] < 1 \
            or kw["burst_every"] < 0 or kw["required"] < 0 or kw["batch_lines"] < 0 or kw["max_tokens"] < 0 \
            or not (0 <= kw["finish_batch_s"] <= 86400 or kw["finish_batch_s"] == -1):
        raise click.UsageError("--steps and --clients must be >= 1; --batch-lines, --rollout-s, --train-s, --burst-every, "
                               "--required, --max-tokens >= 0; --gib > 0; --finish-batch-s in [0, 86400]")
    bad = [o for o in overrides if not o.startswith("timeslice.") or "=" not in o]
    if bad:
        raise click.UsageError(f"--set takes timeslice.KEY=VALUE, not {', '.join(map(repr, bad))}")
    if kw["solo"] and (overrides or kw["wedge_at"]):
        raise click.UsageError("--solo runs without the interleave section and without a tenant: --set and --wedge-at "
                               "have nothing to act on")
    if kw["validate_every"] < 0 or ((kw["policy_url"] or kw["policy_model"]) and not kw["validate_every"]):
        raise click.UsageError("--validate-every takes a number of versions >= 0; --policy-url and --policy-model "
                               "need --validate-every")
    if kw["policy_model"] and not kw["policy_url"]:
        raise click.UsageError("--policy-model is the model --policy-url serves: name the running vLLM too")
    if kw["validate_every"]:
        missing = _missing(*VALIDATION_MODULES, *(("transformers",) if kw["policy_model"] else ()))
        if missing:
            raise click.ClickException(f"--validate-every needs the 'verl' extra (missing: {', '.join(missing)}): "
                                       "pip install '.[verl]' in a clone of timeslice-verl, or leave --validate-every off")
    if kw["burst_every"] and kw["profile"] != "even":
        raise click.UsageError("--burst-every shapes the even schedule; a --profile has its own arrivals")
    if kw["wedge_at"] and (kw["vllm_url"] or not 1 <= kw["wedge_at"] <= kw["steps"]):
        raise click.UsageError("--wedge-at needs a step of the run (1..--steps) and a tenant the demo supervises "
                               "(not --vllm-url)")
    if not kw["solo"]:
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            raise click.UsageError("the demo submits its batch work to the batch service, which needs the 'batch' extra: "
                                   "pip install 'timeslice-verl[batch]' (or run --solo)") from None


VALIDATION_MODULES = ("verl", "torch", "pandas", "pyarrow")
"""What the demo's validation imports: verl's reward function, the trainer's model, the validation set's parquet."""


def _missing(*modules: str) -> list[str]:
    """The ``modules`` that cannot be imported here (looked up, not imported: verl takes seconds to import)."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    return [m for m in modules if absent(m)]


def _echo_demo(summary: dict[str, Any], solo: bool) -> None:
    from timeslice_verl import analysis

    click.echo("")
    click.echo(summary["mode"]["label"])
    if solo:  # +timeslice=observe: nothing was handed over, only the steps tell
        click.echo(f"job demo: {len(summary['steps_detail'])} steps in {summary['wall_s']:.1f} s, solo (the trainer "
                   "keeps its GPU)")
    else:
        click.echo(analysis.render_summary(summary))
    click.echo(f"  median step {summary['step_s_median']:.3f} s over {len(summary['steps_detail'])} steps")
    b = summary.get("batch") or {}
    if b.get("id"):
        rate = f", {b['tokens_per_gpu_s']:.0f} tokens/s while the tenant had the GPU" if b.get("tokens_per_gpu_s") else ""
        click.echo(f"  batch {b['id']}: {b['completed']} of {b['lines']} lines answered ({b['retried']} retried, "
                   f"{b['failed']} failed, {b['not_sent']} not sent when the run ended, {b['lost']} lost){rate}")
    elif b.get("error"):
        click.echo(f"  batch: {b['error']}")
    stop = summary.get("tenant_stop")
    if stop and stop.get("stopped"):
        click.echo(f"  tenant stopped in step {stop['step']}: reclaimed by {stop['reclaim'] or '?'}; trainer waited "
                   f"{stop['trainer_wait_s']} s; supervisor restarts: {stop['restarts']} (restart {stop['restart_s']} s)")
    v = summary.get("validation")
    if v:
        done = [r for r in v["runs"] if not r["error"]]
        click.echo(f"  validation: {len(done)} of {len(v['runs'])} runs (versions "
                   f"{', '.join(str(r['version']) for r in v['runs']) or '-'}), {len(v['late'])} late report(s), "
                   f"{len(v['logged'])} logged to the tracker")
    click.echo(f"  worker data intact: {summary['worker_data_intact']}")
    for name, path in summary["files"].items():
        click.echo(f"  {name:10} {path}")


@main.command("options")
def options_cmd() -> None:
    """List the options of the Hydra group (+timeslice=OPTION)."""
    for name in options():
        click.echo(name)


def _add_serving() -> None:
    from timeslice_verl.tools.serving_cli import batch_group, tenant_group

    main.add_command(batch_group)
    main.add_command(tenant_group)


_add_serving()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
