"""``timeslice-verl demo --wedge-at STEP``: the tenant stops answering in the middle of a valley (SIGSTOP, as a
hung server would), and the demo reports what followed — when the agent saw it wedged, how the trainer's reclaim
went (the ladder's kill), how long the supervisor took to bring the tenant back, whether the batch lost lines.

The stopped process is the one the supervisor registered with the agent; it is never left stopped (``close``
continues it if the ladder did not kill it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.log import get_logger

log = get_logger("demo")


class TenantStop:
    def __init__(self, agent_socket: Path, step: int) -> None:
        self.agent_socket, self.step = agent_socket, step
        self.pid = 0
        self.stopped_at = 0.0
        self._disarm = threading.Event()
        self._thread: threading.Thread | None = None
        self.reclaimed: dict[str, Any] = {}
        """The agent's status right after the step's reclaim."""

    def arm(self, step: int) -> None:
        """At the start of ``step``'s valley: stop the tenant once it has the GPU (if this is the step)."""
        if step == self.step and self._thread is None:
            self._thread = threading.Thread(target=self._stop_when_lent, daemon=True, name="demo-tenant-stop")
            self._thread.start()

    def _stop_when_lent(self) -> None:
        try:
            with AgentClient(self.agent_socket, connect_timeout_s=10, client="demo-fault") as agent:
                owner = agent.status()["owner"]
                while owner != "tenant" and not self._disarm.is_set():
                    owner = agent.watch_owner(owner, 1.0)["owner"]
                if self._disarm.is_set():
                    log.warning("demo: step %d lent no valley: the tenant was not stopped", self.step)
                    return
                self.pid = int(((agent.status().get("tenant") or {}).get("supervisor") or {}).get("pid") or 0)
        except AgentError as exc:
            log.error("demo: --wedge-at: the agent does not answer: %s", exc)
            return
        if not self.pid:
            log.error("demo: --wedge-at: the tenant has no supervisor pid: not stopped")
            return
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped_at = time.time()
        log.warning("demo: tenant pid %d stopped (SIGSTOP) in step %d's valley", self.pid, self.step)

    def disarm(self) -> None:
        self._disarm.set()
        if self._thread is not None:
            self._thread.join(30)

    def reclaimed_in(self, step: int) -> None:
        """After ``step``'s reclaim: what the agent says of it (the tenant's last yield, the ladder)."""
        if step != self.step:
            return
        self.disarm()
        try:
            with AgentClient(self.agent_socket, connect_timeout_s=10, client="demo-fault") as agent:
                self.reclaimed = agent.status()
        except AgentError as exc:
            log.error("demo: --wedge-at: no status after the reclaim: %s", exc)

    def figures(self, status: dict[str, Any], step_log: list[dict[str, Any]]) -> dict[str, Any]:
        """What followed the stop: the reclaim (the status right after it), the restart (``status``: at the end)."""
        if not self.stopped_at:
            return {"step": self.step, "stopped": False}
        tenant = self.reclaimed.get("tenant") or {}
        sup = (status.get("tenant") or {}).get("supervisor") or {}
        step = next((s for s in step_log if s["step"] == self.step), {})
        yield_at = tenant.get("yield_at") or 0.0
        return {"step": self.step, "stopped": True, "pid": self.pid,
                "stopped_before_reclaim_s": round(yield_at - self.stopped_at, 3) if yield_at else None,
                "reclaim": tenant.get("yield_detail", ""),
                "ladder": self.reclaimed.get("ladder", {}), "trainer_wait_s": step.get("timeslice/acquire_wait_s"),
                "restarts": sup.get("restarts"), "restart_s": sup.get("restart_s"), "tenant_start_s": sup.get("start_s"),
                "last_exit": sup.get("last_exit")}

    def close(self) -> None:
        """Never leave the tenant stopped (a valley that was skipped, a ladder that did not kill it)."""
        self.disarm()
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


__all__ = ["TenantStop"]
