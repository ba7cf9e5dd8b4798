"""The plugin manager: a typed facade over pluggy, built in each process that fires events.

Plugins come from three places, in this order (later registrations are called first, as in pluggy):

1. bundled plugins (``agent``, ``timeline``, ``metrics``), unless listed in ``plugins.disabled``;
2. installed distributions that publish an entry point in the group ``timeslice_verl``
   (``name = "package.module"`` or ``"package.module:object"``), filtered by ``plugins.enabled``
   and ``plugins.disabled``;
3. ``plugins.modules`` from the config (``package.module`` or ``package.module:attr``).

A plugin is a module, an instance, or a class with a no-argument constructor (instantiated here).
Entry points are loaded by pluggy's own loader (``load_setuptools_entrypoints``), one name at a time so a
failure names its plugin. After loading, :meth:`TimesliceManager.check` rejects hook implementations that match
no hook — a misspelled hook fails at load with the name and the closest real hook, never silently at run time.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import threading
import time
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable

import pluggy

from timeslice_verl.hooks import spec as hookspecs
from timeslice_verl.config.schema import PluginSettings
from timeslice_verl.log import get_logger

log = get_logger("plugins")

ENTRY_POINT_GROUP = hookspecs.PROJECT
BUNDLED: dict[str, str] = {
    "agent": "timeslice_verl.plugins.agent:AgentPlugin",
    "timeline": "timeslice_verl.plugins.timeline:TimelinePlugin",
    "metrics": "timeslice_verl.plugins.metrics:MetricsPlugin",
}


@dataclass(frozen=True)
class HookError:
    """An exception a plugin's hook implementation raised (gating: it also propagated; observing: it was logged)."""

    plugin: str
    hook: str
    error: BaseException


class PluginLoadError(RuntimeError):
    """A plugin could not be imported, built or validated. The message names the plugin."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str
    """``bundled``, ``entry point <dist>``, ``config`` or ``registered``."""
    hooks: tuple[str, ...]


def import_object(spec: str) -> Any:
    """Import ``package.module`` or ``package.module:attr.sub`` (the config and entry-point form)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginLoadError(f"plugin {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginLoadError(f"plugin {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def _instantiate(obj: Any, name: str) -> Any:
    if not inspect.isclass(obj):
        return obj
    try:
        return obj()
    except Exception as exc:
        raise PluginLoadError(f"plugin {name!r}: constructing {obj.__qualname__} failed: {exc}") from exc


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager whose ``register`` — the one its entry-point loader calls too — goes through the owner's
    (a class is built, the hooks get their error policy)."""

    def __init__(self, owner: TimesliceManager) -> None:
        super().__init__(hookspecs.PROJECT)
        self.owner = owner

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        return self.owner.register(plugin, name, source=self.owner._loading or "registered")

    def register_guarded(self, guarded: Any, name: str) -> str | None:
        return super().register(guarded, name=name)


class TimesliceManager:
    """pluggy's PluginManager with the timeslice hookspec, plugin sources and load-time checks."""

    def __init__(self) -> None:
        self._loading = ""
        self.pm = _PluginManager(self)
        for spec in hookspecs.SPEC_CLASSES:
            self.pm.add_hookspecs(spec)
        self._sources: dict[str, str] = {}
        self._by_id: dict[int, str] = {}
        self._disabled: list[str] = []
        self.hook_errors: list[HookError] = []
        """Every error a plugin raised in a hook, in order: what the test kit's strict mode fails a test on."""

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def register(self, plugin: Any, name: str | None = None, *, source: str = "registered") -> str:
        """Register one plugin object; a clear error if its hooks do not match the spec.

        pluggy registers a :class:`_Guarded` stand-in that carries the plugin's hook implementations,
        each under its hook's error policy; the plugin object itself is never modified.
        """
        plugin = _instantiate(plugin, name or _default_name(plugin))
        if id(plugin) in self._by_id:
            raise PluginLoadError(f"plugin {name or plugin!r}: already registered as {self._by_id[id(plugin)]!r}")
        guarded = _Guarded(plugin, name or _default_name(plugin), self.pm, self.hook_errors.append)
        try:
            registered = self.pm.register_guarded(guarded, name or _default_name(plugin))
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"plugin {name or plugin!r}: {exc}") from exc
        except ValueError as exc:  # duplicate name
            raise PluginLoadError(f"plugin {name or plugin!r}: {exc}") from exc
        if registered is None:  # blocked name
            return name or ""
        self._sources[registered] = source
        self._by_id[id(plugin)] = registered
        return registered

    def load(
        self,
        settings: PluginSettings,
        *,
        bundled: Iterable[str] = tuple(BUNDLED),
    ) -> TimesliceManager:
        """Register bundled, entry-point and config plugins per ``settings``, then :meth:`check`."""
        disabled = set(settings.disabled)
        known = set(BUNDLED) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(settings.modules)
        for name in sorted(disabled - known):
            hint = difflib.get_close_matches(name, sorted(known), n=1)
            raise PluginLoadError(
                f"timeslice.plugins.disabled names {name!r}, which is no plugin here"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (bundled: {', '.join(BUNDLED)}; installed: {', '.join(sorted(known - set(BUNDLED))) or 'none'})"
            )
        self._disabled = sorted(disabled)
        for name in disabled:
            self.pm.set_blocked(name)
        for name in bundled:
            if name in disabled:
                continue
            self.register(import_object(BUNDLED[name]), name, source=f"bundled (timeslice-verl {_version()})")
        self._load_entry_points(settings, disabled)
        for spec in settings.modules:
            self.register(import_object(spec), spec, source="config")
        self.check()
        return self

    def _load_entry_points(self, settings: PluginSettings, disabled: set[str]) -> None:
        """pluggy's loader, one entry point at a time: an import that fails names its plugin."""
        wanted = None if settings.enabled is None else set(settings.enabled)
        found = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
        for name in found:
            if name in disabled or (wanted is not None and name not in wanted) or self.pm.get_plugin(name) is not None:
                continue
            self._loading = "entry point"
            try:
                loaded = self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
            except PluginLoadError:
                raise
            except Exception as exc:
                raise PluginLoadError(f"plugin {name!r} (entry point of group {ENTRY_POINT_GROUP!r}): import failed: "
                                      f"{exc}") from exc
            finally:
                self._loading = ""
            if loaded:
                dist = self.pm.list_plugin_distinfo()[-1][1]
                self._sources[name] = f"entry point {dist.project_name} {dist.version}".strip()
        if wanted is not None and wanted - set(found):
            missing = ", ".join(sorted(wanted - set(found)))
            raise PluginLoadError(
                f"timeslice.plugins.enabled names {missing}, but no installed distribution publishes "
                f"such an entry point in group {ENTRY_POINT_GROUP!r} (installed: {', '.join(found) or 'none'})"
            )

    def check(self) -> None:
        """Fail on hook implementations that match no hook (misspellings), naming the closest hook: pluggy's
        ``check_pending`` decides, this says which hook was meant."""
        try:
            self.pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            pending = exc
        known = hookspecs.hook_names()
        for name, caller in vars(self.pm.hook).items():
            if name.startswith("_") or caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                hint = difflib.get_close_matches(name, known, n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; known hooks: {', '.join(known)}"
                raise PluginLoadError(f"plugin {impl.plugin_name!r} implements unknown hook {name!r}{suggestion}")
        raise PluginLoadError(str(pending))

    def plugins(self) -> list[PluginInfo]:
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # a blocked (disabled) name, not a plugin
                continue
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or []))
            out.append(PluginInfo(name=name, source=self._sources.get(name, "registered"), hooks=hooks))
        return out

    def disabled(self) -> list[str]:
        """The names ``timeslice.plugins.disabled`` blocked."""
        return list(self._disabled)

    def get(self, name: str) -> Any:
        """The plugin object registered under ``name`` (as given, not pluggy's stand-in), or None."""
        guarded = self.pm.get_plugin(name)
        return guarded.plugin if isinstance(guarded, _Guarded) else guarded

    def call(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call a hook through pluggy: the non-None results in call order, with the hook's error policy."""
        return getattr(self.pm.hook, hook_name)(**kwargs)

    def trace(self, logger: Any, enabled: Callable[[], bool] = lambda: True,
              clock: Callable[[], float] = time.perf_counter) -> None:
        """Log every hook call (hook, plugins, result, duration) through pluggy's call monitoring.

        Start times are kept on a stack per thread: a hook fired from inside another (the agent
        plugin's ``handoff`` inside ``pre_train_step``) is timed on its own, and so is the outer one.
        """
        local = threading.local()

        def before(hook_name: str, impls: list, kwargs: dict) -> None:
            local.__dict__.setdefault("started", []).append(clock())

        def after(outcome: Any, hook_name: str, impls: list, kwargs: dict) -> None:
            ms = (clock() - local.started.pop()) * 1e3
            if not enabled():
                return
            plugins = ", ".join(i.plugin_name for i in reversed(impls))
            result = outcome.exception if outcome.exception is not None else outcome.get_result()
            logger.info("%s [%s] -> %r (%.1f ms)", hook_name, plugins, result, ms)

        self.pm.add_hookcall_monitoring(before, after)


class _Guarded:
    """What pluggy registers for a plugin: its hook implementations, each under its hook's error policy
    (wrappers as they are: they see the other implementations' outcome and decide themselves)."""

    def __init__(self, plugin: Any, name: str, pm: pluggy.PluginManager,
                 sink: Callable[[HookError], None] = lambda error: None) -> None:
        self.plugin = plugin
        known = set(hookspecs.hook_names())
        for attr in dir(plugin):
            opts = pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            function = getattr(plugin, attr)
            hook = opts.get("specname") or attr
            wrapper = opts.get("wrapper") or opts.get("hookwrapper")
            setattr(self, attr, function if wrapper or hook not in known else _guard(function, name, hook, sink))

    def __repr__(self) -> str:
        return repr(self.plugin)


def _default_name(plugin: Any) -> str:
    return str(getattr(plugin, "__name__", None) or id(plugin))


def _guard(function: Callable[..., Any], plugin: str, hook: str,
           sink: Callable[[HookError], None]) -> Callable[..., Any]:
    """The hook's error policy, applied to one plugin's implementation: in a gating hook the error
    propagates (named), in an observing hook it is logged and the other plugins still run."""
    gating = hookspecs.hook_kind(hook) == hookspecs.GATING

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            dt = (time.perf_counter() - t0) * 1e3
            sink(HookError(plugin, hook, exc))
            if gating:
                log.error("plugin %s failed in gating hook %s after %.1f ms: %r", plugin, hook, dt, exc)
                raise
            log.error("plugin %s raised in %s (reported, not fatal): %r", plugin, hook, exc, exc_info=exc)
            return None

    return guarded


def _version() -> str:
    try:
        return importlib.metadata.version("timeslice-verl")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
        return "source"
