"""Every background task is referenced until it ends: asyncio keeps only a weak reference to a running task, so a
task started and dropped may be collected mid-run (its work silently lost)."""

from __future__ import annotations

import ast
import asyncio
import gc
from pathlib import Path

from timeslice_verl.batch import background

SRC = Path(__file__).resolve().parent.parent / "src" / "timeslice_verl"


def _dropped_tasks(tree: ast.AST) -> list[int]:
    """Lines where a task is started as a bare statement (its task object thrown away)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("create_task", "ensure_future"):
                out.append(node.lineno)
    return out


def test_no_module_starts_a_task_and_drops_it():
    dropped = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
               if (lines := _dropped_tasks(ast.parse(p.read_text())))}
    assert dropped == {}, f"start these with timeslice_verl.batch.background.spawn or keep the task: {dropped}"


def test_the_guard_sees_a_dropped_task():
    assert _dropped_tasks(ast.parse("async def f(loop):\n    loop.create_task(g())\n    t = loop.create_task(g())\n")) == [2]


def test_a_spawned_task_is_kept_until_it_ends_and_then_let_go():
    async def scenario() -> tuple[int, int, str]:
        go = asyncio.Event()

        async def work() -> str:
            await go.wait()
            return "done"

        task = background.spawn(work(), "work")
        ref = task.get_name()
        del task
        gc.collect()
        during = background.running()
        go.set()
        while background.running():
            await asyncio.sleep(0)
        return during, background.running(), ref

    assert asyncio.run(scenario()) == (1, 0, "work")
