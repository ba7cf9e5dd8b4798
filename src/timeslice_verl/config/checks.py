"""The checks of a ``timeslice`` section that need more than a type: the error they raise (naming the key), the
tenant's addresses, a DSN that must not be a setting. Kept apart from :mod:`~timeslice_verl.config.schema` (the
schema itself)."""

from __future__ import annotations

import re
from typing import Any

from timeslice_verl.names import clean_urls, repeated_url, valid_url

SECTION = "timeslice"


class ConfigError(ValueError):
    """A bad ``timeslice`` setting. The message names the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def _full_key(key: Any) -> str:
    key = str(key or "").strip(".")
    if key.startswith(SECTION + ".") or key == SECTION:
        return key
    return f"{SECTION}.{key}" if key else SECTION


def setting_at(settings: Any, dotted: str) -> Any:
    """The value of a dotted key (``batch.port``) of a settings object."""
    value: Any = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def no_dsn_in_store(section: Any) -> None:
    """A DSN written as ``batch.store`` would sit on a command line and in every log: refused, without echoing it."""
    store = (section.get("batch") or {}).get("store") if isinstance(section, dict) else None
    if isinstance(store, str) and store not in ("sqlite", "postgresql"):
        looks = "://" in store or "=" in store or "@" in store
        raise ConfigError(_full_key("batch.store"), ("holds what looks like a DSN: " if looks else "is not one of "
                          "'sqlite', 'postgresql'; ") + "write timeslice.batch.store=postgresql and give the DSN in "
                          "TIMESLICE_BATCH_DSN or in a file only you can read (timeslice.batch.dsn_file)")


def check_urls(settings: Any) -> None:
    """Every tenant address a URL, none listed twice; ``tenant.url`` folded into an empty ``tenant.urls`` (the name read
    after; when both are set, ``urls`` wins: an option's default ``url`` never adds a server)."""
    t = settings.tenant
    if t.url and not valid_url(t.url):
        several = " (several servers: timeslice.tenant.urls=[...])" if "," in t.url else ""
        raise ConfigError(_full_key("tenant.url"), f"{t.url!r} is not an http(s) URL{several}")
    for key in ("tenant.urls", "batch.tenant_urls"):
        for i, each in enumerate(setting_at(settings, key)):
            if not valid_url(each):
                raise ConfigError(_full_key(f"{key}[{i}]"), f"{each!r} is not an http(s) URL")
        twice = repeated_url(setting_at(settings, key))
        if twice:
            raise ConfigError(_full_key(key), f"{twice!r} is listed twice (one vLLM server per GPU)")
    t.urls = clean_urls(t.urls or ([t.url] if t.url else []))
    settings.batch.tenant_urls = clean_urls(settings.batch.tenant_urls)


def check_validate(settings: Any) -> None:
    """The validation section: a policy tenant named when it is on, and never one the users' batches go to."""
    v = settings.validate
    if not 0 <= v.every <= 1_000_000:
        raise ConfigError(_full_key("validate.every"), f"must be between 0 and 1000000, got {v.every}")
    if not -100 <= v.priority <= 100:
        raise ConfigError(_full_key("validate.priority"), f"must be between -100 and 100, got {v.priority}")
    for key in ("validate.policy_url", "validate.service_url"):
        value = setting_at(settings, key)
        if value and not valid_url(value):
            raise ConfigError(_full_key(key), f"{value!r} is not an http(s) URL")
    if v.source and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", v.source):
        raise ConfigError(_full_key("validate.source"), f"{v.source!r} is not 'package.module:factory'")
    if v.enable and not v.policy_url:
        raise ConfigError(_full_key("validate.policy_url"), "validation is on (validate.enable=true) but no policy tenant "
                                                             "is named: the URL of a vLLM started with weight transfer")
    if v.policy_url and v.policy_url.rstrip("/") in [u.rstrip("/") for u in settings.batch.tenant_urls]:
        raise ConfigError(_full_key("validate.policy_url"), f"{v.policy_url!r} is also in batch.tenant_urls: the policy "
                                                             "tenant answers validation runs only")


__all__ = ["SECTION", "ConfigError", "check_urls", "check_validate", "no_dsn_in_store", "setting_at"]
