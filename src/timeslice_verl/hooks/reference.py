"""The hook reference, generated from the hookspec docstrings (``timeslice-verl hooks --markdown``)."""

from __future__ import annotations

import inspect

from timeslice_verl.hooks import spec as hookspecs


def _doc(cls: type, name: str) -> str:
    return inspect.cleandoc(getattr(cls, name).__doc__ or "")


def hook_summaries() -> list[tuple[str, str, str]]:
    """``(hook, gating|observing, first docstring line)`` in lifecycle order."""
    out = []
    for cls in hookspecs.SPEC_CLASSES:
        for name in (n for n in vars(cls) if not n.startswith("_") and callable(vars(cls)[n])):
            kind = hookspecs.hook_kind(name)
            out.append((name, kind, _doc(cls, name).splitlines()[0]))
    return out


def hook_reference_markdown() -> str:
    lines = [
        "# Hook reference",
        "",
        "Generated from `timeslice_verl.hooks.spec` (`timeslice-verl hooks --markdown`). Every hook is",
        "called with keyword arguments; implement only the ones you need and declare only the",
        "arguments you use. **Gating** hooks stop the trainer when a plugin raises; **observing** hooks",
        "log the error and go on.",
        "",
    ]
    for cls in hookspecs.SPEC_CLASSES:
        lines += [f"## {cls.__name__}: {inspect.cleandoc(cls.__doc__ or '')}", ""]
        for name in (n for n in vars(cls) if not n.startswith("_") and callable(vars(cls)[n])):
            sig = inspect.signature(getattr(cls, name))
            params = ", ".join(p for p in sig.parameters if p != "self")
            kind = hookspecs.hook_kind(name)  # declared on the spec (@gating / @observing)
            lines += [f"### `{name}`", "", f"`{name}({params})` — *{kind}*", "", _doc(cls, name), ""]
    return "\n".join(lines).rstrip() + "\n"
