"""The tree shows the architecture: imports point one way, no module passes 400 lines nor a function 80, no
hook is fired by a string outside the dispatcher's typed facade, and the product never uses its test kit."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80
FACADE = {"timeslice_verl/hooks/lifecycle.py", "timeslice_verl/hooks/spec.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(nodes: Any, name: str, known: set[str]) -> set[str]:
    """The package's modules that the import statements among ``nodes`` name."""
    found = set()
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for alias in n.names:
                target = f"{n.module}.{alias.name}"
                found.add(target if target in known else n.module)
        elif isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
    return {f for f in found if f in known and f != name}


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Imports at module level, ``if TYPE_CHECKING:`` blocks included (imports inside functions are lazy by design)."""
    body = ast.parse(path.read_text()).body
    return _imports((n for node in body for n in (node.body if isinstance(node, ast.If) else [node])), name, known)


def _all_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every import of the module, those inside functions included (a lazy import still closes a circle)."""
    return _imports(ast.walk(ast.parse(path.read_text())), name, known)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> modules it imports), or []."""
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
    return cycle


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Every import of each module (those inside functions included), from the modules' sources."""
    known = set(sources)
    return {m: _imports(ast.walk(ast.parse(src)), m, known) for m, src in sources.items()}


def test_no_import_cycle_among_the_packages_modules_counting_imports_inside_functions():
    cycle = _cycle(_graph({m: p.read_text() for m, p in _modules().items()}))
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_check_sees_a_circle_closed_by_an_import_inside_a_function():
    sources = {"pkg.ladder": "from pkg.tenant import Tenant\n",
               "pkg.tenant": "def make():\n    from pkg.group import Group\n    return Group()\n",
               "pkg.group": "import pkg.ladder\n"}
    assert _cycle(_graph(sources)) == ["pkg.group", "pkg.ladder", "pkg.tenant", "pkg.group"]
    sources["pkg.group"] = "x = 1\n"
    assert _cycle(_graph(sources)) == []


def test_no_module_over_400_lines():
    long = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_agent_needs_neither_hydra_nor_the_dispatcher():
    mods = _modules()
    agent = {m: p for m, p in mods.items() if m.startswith("timeslice_verl.agent") and not m.endswith(".server")}
    for name, path in agent.items():
        imported = _module_level_imports(name, path, set(mods))
        assert not imported & {"timeslice_verl.config.schema", "timeslice_verl.hooks.lifecycle", "timeslice_verl.hooks.manager"}, (name, imported)


def _layer_table() -> list[tuple[str, list[str], set[str] | None]]:
    """docs/architecture.md's layer table: (layer, module paths named outside parentheses, may import;
    None for everything)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = text[text.index("| layer | modules | may import |"):].split("\n\n")[0].splitlines()[2:]
    table = []
    for row in rows:
        layer, modules, may = (cell.strip() for cell in row.strip().strip("|").split("|"))
        depth, names, token = 0, [], None
        for ch in modules:
            if token is not None:
                if ch == "`":
                    names.append(token)
                    token = None
                else:
                    token += ch
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            elif ch == "`" and depth == 0:
                token = ""
        allowed = None if may == "everything" else {m.strip() for m in may.split(",") if m.strip() not in ("—", "")}
        table.append((layer, names, allowed))
    return table


def _module_of(path: str) -> str:
    if path.startswith("hydra_plugins/"):
        return path.rstrip("/").replace("/", ".")
    dotted = path.removesuffix(".py").removesuffix("__init__").rstrip("/").replace("/", ".").rstrip(".")
    return "timeslice_verl" + ("." + dotted if dotted else "")


def _layer_of(module: str, table) -> str | None:
    best, layer = -1, None
    for name, paths, _ in table:
        for path in paths:
            target = _module_of(path)
            package = path.endswith("/")
            if module == target or (package and module.startswith(target + ".")):
                if len(path) > best:
                    best, layer = len(path), name
    return layer


def test_imports_follow_the_layer_table_of_the_architecture_doc():
    table = _layer_table()
    assert [name for name, _, _ in table][:2] == ["base", "config"], "the table was not found or not parsed"
    allowed = {name: may for name, _, may in table}
    mods = _modules()
    unplaced = sorted(m for m in mods if _layer_of(m, table) is None)
    assert not unplaced, f"modules the layer table of docs/architecture.md does not place: {unplaced}"
    wrong = []
    for name, path in mods.items():
        layer = _layer_of(name, table)
        for target in _module_level_imports(name, path, set(mods)):
            other = _layer_of(target, table)
            may = allowed[layer]
            if other != layer and may is not None and other not in may:
                wrong.append(f"{name} ({layer}) imports {target} ({other})")
    assert not wrong, wrong


def test_the_layer_check_catches_an_upward_import():
    table = _layer_table()
    assert _layer_of("timeslice_verl.agent.server", table) == "agent daemon"
    assert _layer_of("timeslice_verl.agent.freeze.sigstop", table) == "agent"
    assert _layer_of("timeslice_verl.agent.client", table) == "agent client"
    assert _layer_of("timeslice_verl", table) == "base"
    allowed = {name: may for name, _, may in table}
    assert "dispatcher" not in allowed["agent"] and "config" not in allowed["agent"]


TEST_KIT = re.compile(r"timeslice_verl\.testing(\.\w+)*")
"""The test kit and its modules: it may use the product, the product never uses it."""


def _test_kit_uses(source: str, where: str) -> list[str]:
    """Imports of the test kit (inside functions too) and strings naming one of its modules (``-m``, import_module)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        hit = next((n for n in names if TEST_KIT.fullmatch(n)), None)
        if hit:
            found.append((node.lineno, f"{where}:{node.lineno} {hit}"))
    return [text for _, text in sorted(found)]


def test_nothing_outside_the_test_kit_imports_it_or_runs_its_modules():
    kit = SRC / "timeslice_verl" / "testing"
    found = [hit for path in SRC.rglob("*.py") if kit not in path.parents
             for hit in _test_kit_uses(path.read_text(), path.relative_to(SRC).as_posix())]
    assert not found, f"the product uses the test kit (move what it needs out of timeslice_verl/testing/): {found}"


def test_the_test_kit_check_sees_an_import_a_lazy_import_and_a_command_line():
    sample = """
from timeslice_verl.testing import play
import timeslice_verl.testing.recording
from timeslice_verl import testing
def start(port):
    from timeslice_verl.testing.recording import RecordingPlugin
    return [sys.executable, "-m", "timeslice_verl.testing.valleys", "--port", str(port)]
"""
    assert [int(h.split(" ")[0].split(":")[1]) for h in _test_kit_uses(sample, "s.py")] == [2, 3, 4, 6, 7]
    other = 'from timeslice_verl.standin.server import main\n"""Uses timeslice_verl.testing in its tests."""\n'
    assert _test_kit_uses(other, "o.py") == []


def test_no_function_over_80_lines():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


FIRING = {"call", "fire", "notify", "Fire", "_fire", "_fire_here"}
"""What would fire a hook given its name."""


def _fired_by_name(source: str, where: str, hooks: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        first = node.args[0]
        if name in FIRING and isinstance(first, ast.Constant) and first.value in hooks:
            found.append(f"{where}:{node.lineno} {name}({first.value!r})")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and func.value.attr == "hook" \
                and func.attr in hooks:  # pluggy's relay reached past the manager
            found.append(f"{where}:{node.lineno} .hook.{func.attr}")
    return found


def test_no_hook_is_fired_by_a_string_outside_the_facade():
    from timeslice_verl.hooks.spec import hook_names

    hooks = set(hook_names())
    found = [hit for path in SRC.rglob("*.py") if path.relative_to(SRC).as_posix() not in FACADE
             for hit in _fired_by_name(path.read_text(), path.relative_to(SRC).as_posix(), hooks)]
    assert not found, found


def test_the_string_check_sees_a_hook_fired_by_name():
    sample = "def f(lc, e):\n    lc.call('post_rollout', e)\n    lc.fire('pre_train_step', e)\n    pm.hook.handoff(e)\n"
    assert len(_fired_by_name(sample, "sample.py", {"post_rollout", "pre_train_step", "handoff"})) == 3


def test_the_readme_reads_in_a_minute_and_its_tables_live_in_docs():
    """README.md ≤ 180 lines with one headline table; the measured tables are in docs/measured.md (generated)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 180
    assert "<!-- figures:" not in readme and "docs/measured.md" in readme
    assert "<!-- figures:" in (ROOT / "docs" / "measured.md").read_text()


SWAP_MODE_VALUES = {"checkpoint", "park", "park+checkpoint", "resident"}
ONE_SPELLING = "timeslice_verl/names.py"
"""Where the swap modes are spelled (:class:`~timeslice_verl.names.SwapMode`); everywhere else uses the enum."""


def _mentions_swap(node: ast.AST) -> bool:
    return "swap" in ast.unparse(node).lower()


def _swap_spellings(source: str, where: str) -> list[str]:
    """A swap mode written as a string where a swap value is meant: compared with one, given as one (``swap=``, a
    parameter or field named swap, ``.get("swap", …)``), returned, or listed beside another mode."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hits: list[ast.AST] = []
        if isinstance(node, ast.Compare) and any(_mentions_swap(n) for n in [node.left, *node.comparators]):
            hits = [n for c in [node.left, *node.comparators] for n in ast.walk(c)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            modes = [e for e in node.elts if isinstance(e, ast.Constant) and e.value in SWAP_MODE_VALUES]
            hits = modes if len(modes) > 1 else []
        elif isinstance(node, ast.keyword) and node.arg == "swap":
            hits = [node.value]
        elif isinstance(node, ast.arguments):
            named = [*node.posonlyargs, *node.args]
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            hits = [d for a, d in pairs if "swap" in a.arg]
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _mentions_swap(node.target):
            hits = [node.value]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "swap":
            hits = node.args[1:]
        elif isinstance(node, ast.Return) and node.value is not None:
            hits = list(node.value.elts[:1]) if isinstance(node.value, ast.Tuple) else [node.value]
        found += [f"{where}:{h.lineno} {h.value!r}" for h in hits
                  if isinstance(h, ast.Constant) and h.value in SWAP_MODE_VALUES]
    return sorted(set(found))


def test_the_swap_modes_are_spelled_once():
    found = [hit for path in SRC.rglob("*.py") if path.relative_to(SRC).as_posix() != ONE_SPELLING
             for hit in _swap_spellings(path.read_text(), path.relative_to(SRC).as_posix())]
    assert not found, f"a swap mode spelled as a string (use timeslice_verl.names.SwapMode): {found}"


def test_the_spelling_check_sees_a_second_spelling_of_the_swap_modes():
    sample = """
PARKING = ("park", "park+checkpoint")
def release(job, swap="checkpoint"):
    if swap == "resident":
        return client.release(job, swap="resident")
    mode = args.get("swap", "checkpoint")
class Job:
    swap: str = "checkpoint"
def choose():
    return "park", "it fits"
"""
    assert {int(h.split(" ")[0].split(":")[1]) for h in _swap_spellings(sample, "s.py")} == {2, 3, 4, 5, 6, 8, 10}
    other = 'phases = {"checkpoint": 1.0}\nif cmd[0] in ("reserve", "park"):\n    ask("park")\n'
    assert _swap_spellings(other, "o.py") == []


LEGACY_URL_READER = ("timeslice_verl/agent/state.py", "_recorded_urls")
"""The one place that reads tenant addresses joined by commas: a state file written before they were a list."""


def _joined_urls(source: str, where: str) -> list[str]:
    """Tenant addresses taken apart from, or put together into, one comma-joined string."""
    found = []
    tree = ast.parse(source)
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        if (where, getattr(fn, "name", "")) == LEGACY_URL_READER:
            continue
        body = fn.body if isinstance(fn, ast.Module) else [fn]
        for node in (n for b in body if not isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) or b is fn
                     for n in ast.walk(b)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            comma = lambda n: isinstance(n, ast.Constant) and n.value == ","  # noqa: E731  (", " is a display)
            if node.func.attr == "split" and node.args and comma(node.args[0]) and "url" in ast.unparse(node.func.value).lower():
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif node.func.attr == "join" and comma(node.func.value) and "url" in ast.unparse(node).lower():
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return sorted(set(found))


def test_tenant_addresses_are_never_a_comma_joined_string():
    found = [hit for path in SRC.rglob("*.py")
             for hit in _joined_urls(path.read_text(), path.relative_to(SRC).as_posix())]
    assert not found, f"tenant addresses are a list from the config to the wire: {found}"


def test_the_address_check_sees_a_split_and_a_join_of_tenant_addresses():
    sample = """
urls = settings.tenant.url.split(",")
def register(url):
    return [u for u in url.split(",") if u]
wire = ",".join(m.url for m in members)
gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
shown = ", ".join(names)
"""
    assert [h.split(" ")[0] for h in _joined_urls(sample, "s.py")] == ["s.py:2", "s.py:4", "s.py:5"]
    legacy = "def _recorded_urls(d):\n    return d['url'].split(',')\n"
    assert _joined_urls(legacy, LEGACY_URL_READER[0]) == []
