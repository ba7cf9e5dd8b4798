"""The ``timeslice`` section in the trainer's override syntax, outside verl.

:func:`compose` reads it as verl's own Hydra app would: the overrides go to Hydra verbatim, against a
primary config that, like verl's, has no ``timeslice`` section of its own — so what verl refuses
(``timeslice=interleave`` without ``+``, two options, an unknown key) is refused here with Hydra's
own message. :func:`to_overrides` writes a section back (the autostarted agent, ``timeslice-verl config``).
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from timeslice_verl.config.suggest import suggest_key, suggest_value
from timeslice_verl.config.schema import SECTION, ConfigError, TimesliceSettings, _full_key, load_settings

SCHEMA_GROUP = "timeslice_schema"
"""Where the schema lives in Hydra's ConfigStore: outside the ``timeslice`` group, so it is never
offered as an option (``+timeslice=…``)."""
PRIMARY = "timeslice_cli"
"""The primary config :func:`compose` stands in for verl's with: empty."""


def register_schema() -> None:
    """Put the schema into Hydra's ConfigStore (``timeslice_schema/base``); the options extend it."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group=SCHEMA_GROUP, name="base", node=TimesliceSettings)
    store.store(name=PRIMARY, node={})


def conf_dir() -> Path:
    """The shipped Hydra config directory (inside the wheel, or ``conf/`` of a source checkout)."""
    package = Path(__file__).resolve().parent.parent  # src/timeslice_verl, or the installed package
    packaged = package / "conf"
    if (packaged / SECTION).is_dir():
        return packaged
    source = package.parent.parent / "conf"
    if (source / SECTION).is_dir():
        return source
    raise FileNotFoundError(f"timeslice-verl's Hydra config directory is missing (looked in {packaged} and {source})")


def options() -> list[str]:
    """The option names of the ``timeslice`` group (``+timeslice=<option>``)."""
    return sorted(p.stem for p in (conf_dir() / SECTION).glob("*.yaml"))


def picks_option(override: str) -> bool:
    """Whether ``override`` chooses the group's option (``+timeslice=…``, ``timeslice=…``, ``~timeslice``)."""
    return override.partition("=")[0].lstrip("+~") == SECTION


def check_overrides(overrides: list[str]) -> None:
    """Refuse what this command could not apply: anything outside the ``timeslice`` section."""
    for item in overrides:
        key = item.partition("=")[0].lstrip("+~")
        if key != SECTION and not key.startswith(SECTION + "."):
            raise ConfigError(
                key or item, f"{item!r} is not a timeslice setting: this command reads only "
                f"'+{SECTION}=<option>' and '{SECTION}.<key>=<value>'",
            )


def compose(option: str = "interleave", overrides: list[str] | None = None) -> TimesliceSettings:
    """The validated section of ``overrides`` (verl's syntax); ``+timeslice=<option>`` is added when
    no override picks an option."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    given = list(overrides or [])
    check_overrides(given)
    if not any(picks_option(o) for o in given):
        given.insert(0, f"+{SECTION}={option}")
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name=PRIMARY, overrides=given)
    except OmegaConfBaseException as exc:
        raise _typo(given) or ConfigError(_full_key(getattr(exc, "full_key", "")), str(exc).splitlines()[0]) from None
    except Exception as exc:  # Hydra's own override / composition errors: its words, as verl prints them
        if not type(exc).__module__.startswith("hydra"):
            raise
        raise _typo(given) or _hydra_error(exc) from None
    if SECTION not in cfg:
        if any(o.startswith("~") and picks_option(o) for o in given):
            raise ConfigError(SECTION, "no section left to show (an override removed it)")
        raise ConfigError(SECTION, "the option chosen sets only verl's keys (one_gpu), no timeslice section: "
                          "time-slicing stays off; combine it with another, e.g. +timeslice=[one_gpu,interleave]")
    try:
        return load_settings(cfg.get(SECTION))
    except ConfigError as exc:  # an appended key (+timeslice.…) the schema lacks surfaces here
        raise _typo(given) or exc from None


def _typo(given: list[str]) -> ConfigError | None:
    """The first override whose key the schema lacks but nearly has, or whose value nearly is one of its
    choices: named, with what it meant (Hydra would advise "+key" for the key, which adds a wrong one)."""
    for item in given:
        key, _, value = item.partition("=")
        meant = suggest_key(TimesliceSettings, SECTION, key)
        if meant is not None:
            return ConfigError(key.lstrip("+~"), f"no such setting; did you mean {meant}?")
        close = suggest_value(TimesliceSettings, SECTION, key, value)
        if close is not None:
            return ConfigError(key.lstrip("+~"), f"{value!r} is not one of its choices; did you mean {close!r}?")
    return None


def _hydra_error(exc: Exception) -> ConfigError:
    lines = str(exc).splitlines()
    if "Config search path:" in lines:  # where Hydra looked: this machine's paths, not the user's mistake
        lines = lines[: lines.index("Config search path:")]
    message = " ".join(line.strip() for line in lines if line.strip())
    cause = exc.__cause__
    key = getattr(cause, "full_key", "") if isinstance(cause, OmegaConfBaseException) else ""
    if cause is not None and str(cause).strip():
        message += f" ({str(cause).splitlines()[0]})"
    return ConfigError(_full_key(key), message)


def _override_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (strings quoted, so paths and URLs pass unchanged)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def to_overrides(settings: TimesliceSettings, sections: tuple[str, ...] | None = ("agent", "tenant")) -> list[str]:
    """Keys as ``timeslice.<key>=<value>`` overrides (``sections``: only those; None: the whole section):
    how a process started from this one (the autostarted agent) gets the same settings, all of them."""
    out = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if not dataclasses.is_dataclass(value):
            if sections is None:
                out.append(f"{SECTION}.{f.name}={_override_value(value)}")
            continue
        if sections is not None and f.name not in sections:
            continue
        out += _nested(f"{SECTION}.{f.name}", value)
    return out


def _nested(prefix: str, group: Any) -> list[str]:
    """A group's keys as overrides, those of its own groups (``batch.postgresql``) included."""
    out = []
    for g in dataclasses.fields(group):
        value = getattr(group, g.name)
        out += _nested(f"{prefix}.{g.name}", value) if dataclasses.is_dataclass(value) else \
            [f"{prefix}.{g.name}={_override_value(value)}"]
    return out


__all__ = ["check_overrides", "compose", "conf_dir", "options", "register_schema", "to_overrides"]
