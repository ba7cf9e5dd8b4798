"""The tree shows the architecture: imports point one way, no module grows past ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Imports at module level, ``if TYPE_CHECKING:`` blocks included (imports inside functions are lazy by design)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        for n in (node.body if isinstance(node, ast.If) else [node]):
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                for alias in n.names:
                    target = f"{n.module}.{alias.name}"
                    found.add(target if target in known else n.module)
            elif isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
    return {f for f in found if f in known and f != name}


def test_no_import_cycle_among_the_packages_modules():
    mods = _modules()
    graph = {m: _module_level_imports(m, p, set(mods)) for m, p in mods.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for nxt in sorted(graph[m]):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt):] + [m, nxt] if nxt in path else [m, nxt])
                return True
            if nxt not in state and visit(nxt, path + [m]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and visit(m, []):
            break
    assert not cycle, " -> ".join(cycle)


def test_no_module_over_400_lines():
    long = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_agent_needs_neither_hydra_nor_the_dispatcher():
    mods = _modules()
    agent = {m: p for m, p in mods.items() if m.startswith("timeslice_verl.agent") and not m.endswith(".server")}
    for name, path in agent.items():
        imported = _module_level_imports(name, path, set(mods))
        assert not imported & {"timeslice_verl.config", "timeslice_verl.lifecycle", "timeslice_verl.manager"}, (name, imported)
