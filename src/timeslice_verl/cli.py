"""``timeslice-verl``: the command line."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from timeslice_verl import __version__
from timeslice_verl.config import ConfigError, compose, options
from timeslice_verl.log import setup_cli_logging


def _settings_from(option: str, overrides: tuple[str, ...]):
    try:
        return compose(option, list(overrides))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="timeslice-verl")
@click.option("--log-level", default="INFO", show_default=True, help="Level of the 'timeslice' logger.")
def main(log_level: str) -> None:
    """Lend the idle GPU of a verl fully-async trainer to a co-resident vLLM server."""
    setup_cli_logging(log_level)


@main.command("config")
@click.option("--option", "option", default="interleave", show_default=True, help="Option of the timeslice group.")
@click.argument("overrides", nargs=-1)
def config_cmd(option: str, overrides: tuple[str, ...]) -> None:
    """Print the validated timeslice section for OPTION plus dotted OVERRIDES."""
    settings = _settings_from(option, overrides)
    click.echo(json.dumps({"timeslice": dataclasses.asdict(settings)}, indent=2))


@main.command("hooks")
@click.option("--markdown", is_flag=True, help="Print the hook reference as Markdown.")
def hooks_cmd(markdown: bool) -> None:
    """List the lifecycle hooks plugins can implement."""
    from timeslice_verl.reference import hook_reference_markdown, hook_summaries

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
    from timeslice_verl.manager import PluginLoadError, TimesliceManager

    settings = _settings_from(option, overrides)
    try:
        manager = TimesliceManager().load(settings.plugins)
    except PluginLoadError as exc:
        raise click.ClickException(str(exc)) from None
    for info in manager.plugins():
        click.echo(f"{info.name:20} {info.source:28} {', '.join(info.hooks)}")


@main.command("agent", context_settings={"ignore_unknown_options": True})
@click.option("--option", "option", default="interleave", show_default=True, help="Option of the timeslice group.")
@click.argument("overrides", nargs=-1)
def agent_cmd(option: str, overrides: tuple[str, ...]) -> None:
    """Run the node's snapshot agent in the foreground (stop with SIGTERM or Ctrl-C).

    Takes the same dotted overrides as the trainer, e.g.
    ``timeslice-verl agent timeslice.tenant.url=http://127.0.0.1:8000 timeslice.agent.gpus=[0]``.
    """
    import asyncio

    from timeslice_verl.agent.server import AgentStartError, run_agent

    settings = _settings_from(option, overrides)
    try:
        asyncio.run(run_agent(settings))
    except AgentStartError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # bad GPU index and the like, named by key
        raise click.ClickException(str(exc)) from None


@main.command("status", context_settings={"ignore_unknown_options": True})
@click.option("--option", "option", default="interleave", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the agent's raw status as JSON.")
@click.argument("overrides", nargs=-1)
def status_cmd(option: str, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Show who owns the GPU, the jobs, the tenant and the queue, as the agent sees them."""
    from timeslice_verl.agent.client import AgentClient, AgentError
    from timeslice_verl.config import socket_path
    from timeslice_verl.status import render_status

    settings = _settings_from(option, overrides)
    try:
        with AgentClient(socket_path(settings), connect_timeout_s=2.0, client="cli") as client:
            status = client.status()
    except AgentError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(status, indent=2) if as_json else render_status(status))


@main.command("options")
def options_cmd() -> None:
    """List the options of the Hydra group (``+timeslice=<option>``)."""
    for name in options():
        click.echo(name)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
