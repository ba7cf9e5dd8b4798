"""What NVML saw each job use while it held the GPU, and the two questions the arbiter asks of it: may this yield
only pause the tenant (:func:`~timeslice_verl.agent.tenant.hold.decide`), and must a tenant held awake sleep now
(:func:`~timeslice_verl.agent.tenant.hold.tight`)."""

from __future__ import annotations

from typing import Any, Iterable

from timeslice_verl.agent.tenant.hold import Fit, HoldPolicy, decide, tight
from timeslice_verl.agent.state import Job
from timeslice_verl.log import get_logger

log = get_logger("agent")


class Peaks:
    def __init__(self, probe: Any | None, policy: HoldPolicy) -> None:
        self.probe, self.policy = probe, policy
        self.peak: dict[str, int] = {}
        """Job name → the most its processes were seen to use on the agent's GPUs while it held them."""
        self.tight = False
        """A tenant is held awake and the trainer ate into the margin: it must sleep (the policy's ``tenant_sleep``)."""
        self.why = ""
        self.last_fit: Fit | None = None

    def _usage(self) -> dict[int, int]:
        return self.probe.process_memory() if self.probe is not None else {}

    def sample(self, jobs: Iterable[Job], held: bool) -> bool:
        """Update the holders' peaks; while a tenant is held awake, whether it must sleep. True when it newly must."""
        holders = [j for j in jobs if j.holding]
        if self.probe is None or not (holders or held):
            self.tight = False
            return False
        usage = self._usage()
        for job in holders:
            used = sum(usage.get(pid, 0) for pid in job.pids())
            if used > self.peak.get(job.name, 0):
                if self.peak.get(job.name):
                    log.info("job %s: its GPU memory peak grew to %.2f GiB", job.name, used / 2**30)
                self.peak[job.name] = used
        was = self.tight
        if not held:
            self.tight = False
            return False
        free = self.probe.memory().free
        peak = max((self.peak.get(j.name, 0) for j in holders), default=0)
        self.tight = tight(self.policy, free=free, job_peak=peak)
        if self.tight and not was:
            self.why = (f"{free / 2**30:.2f} GiB free, under half the {self.policy.margin(peak) / 2**30:.2f} GiB margin "
                        f"beside the trainer (peak {peak / 2**30:.2f} GiB)")
        return self.tight and not was

    def fit(self, job: Job | None) -> Fit:
        """Whether the yield before ``job`` gets the GPU may be a pause alone; logged when the answer changes."""
        if job is None or self.probe is None:
            got = decide(self.policy, free=None, job_now=0, job_peak=0)
        else:
            now = sum(self._usage().get(pid, 0) for pid in job.pids())
            got = decide(self.policy, free=self.probe.memory().free, job_now=now, job_peak=self.peak.get(job.name, 0))
        if self.last_fit is None or got.pause_only != self.last_fit.pause_only:
            log.info("tenant yields by %s: %s", "a pause alone" if got.pause_only else "pause and sleep", got.why)
        self.last_fit = got
        return got

    def forget(self, name: str) -> None:
        self.peak.pop(name, None)


__all__ = ["Peaks"]
