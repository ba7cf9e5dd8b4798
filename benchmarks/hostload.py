"""What the harvest benchmark's sampler records beside vLLM's metrics, so that a server slower in one row than in the
next (an H200 on 2026-12-02: 32 000 against 47 575 tokens/s at the same running count, two minutes apart) can be told
apart: the host's busy CPU share, the CPU each vLLM process used (in cores: its API server and engine core are Python
loops whose pace can be the server's), and the GPU's SM clock and utilisation (nvidia-ml-py, when it loads). The engine
core runs one core flat out on an H200 with a small model, so its pace is that core's: the sampler also records the CPU
time the hypervisor took (steal), host-wide and on the engine core's CPU, and how busy the other threads of its
physical core were (an H200 on 2026-12-03: the same server at the same running count read 29 000 in one pass and 46 000
tokens/s in the next, the engine core at one core in both), and how its one core split between its threads
(``engine_threads``: on CPUs of its own, no steal, its passes were still a third to a half apart). Read only: nothing
here signals or changes another process. With a CPU named, a child of its own reads that CPU's pace (``cpu_speed``,
:mod:`cpuspeed`): a host whose clock moved under the guest reads as a slower interpreter."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil
from cpuspeed import SpeedProbe

log = logging.getLogger("timeslice.bench")

ROLES = (("EngineCore", "engine_core"), ("APIServer", "api_server"), ("vllm.entrypoints", "api_server"),
         ("vllm serve", "api_server"), ("VLLM::", "worker"))
"""A vLLM process's role by what its command line holds (vLLM names its engine core ``VLLM::EngineCore`` and, with
``--api-server-count``, each front end ``…APIServer…``), first match wins."""


class Busy(NamedTuple):
    busy: float
    total: float


def host_busy(times: Any) -> Busy:
    """CPU seconds busy and in all from ``psutil.cpu_times()`` (idle and waiting on I/O are not busy)."""
    total = sum(times)
    idle = times.idle + getattr(times, "iowait", 0.0)
    return Busy(total - idle, total)


def busy_share(before: Busy, after: Busy) -> float | None:
    """The share of the host's CPU time that was busy between two reads; None when no time passed."""
    total = after.total - before.total
    return round(max(0.0, min(1.0, (after.busy - before.busy) / total)), 4) if total > 0 else None


def cpu_share(before: Any, after: Any) -> tuple[float | None, float | None]:
    """(busy, steal): the shares of one CPU's (or the host's) time between two ``cpu_times`` reads that it worked and
    that the hypervisor took; busy leaves idle, I/O wait and steal out. (None, None) when no time passed. Linux counts
    a guest's time inside user and nice as well: left out of the sum."""
    def whole(t: Any) -> float:
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    total = whole(after) - whole(before)
    if total <= 0:
        return None, None
    steal = getattr(after, "steal", 0.0) - getattr(before, "steal", 0.0)
    idle = after.idle + getattr(after, "iowait", 0.0) - before.idle - getattr(before, "iowait", 0.0)
    return (round(max(0.0, min(1.0, (total - idle - steal) / total)), 4), round(max(0.0, min(1.0, steal / total)), 4))


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``0,8``, ``0-1,16-17``: sysfs's ``thread_siblings_list``) as CPU numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def measured_mates() -> dict[int, list[int]]:
    """CPU -> its mates as ``benchmarks/cpumates.py`` measured them, where ``PIN_MATES`` names its output (a VM that
    hides SMT: sysfs shows every CPU alone); {} where unset."""
    path = os.environ.get("PIN_MATES", "").strip()
    if not path:
        return {}
    try:
        mates = json.loads(Path(path).read_text())["mates"]
        return {int(cpu): [int(m) for m in found] for cpu, found in mates.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"PIN_MATES={path}: not the output of benchmarks/cpumates.py ({exc})") from exc


def core_mates(cpu: int, sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """The other logical CPUs of ``cpu``'s physical core (its SMT threads): what sysfs says and what
    :func:`measured_mates` found; none where neither says."""
    try:
        shown = [c for c in parse_cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
                 if c != cpu]
    except OSError:
        shown = []
    return sorted({*shown, *measured_mates().get(cpu, [])})


def vllm_role(cmdline: list[str]) -> str | None:
    """``engine_core``, ``api_server`` or ``worker`` for a vLLM process's command line, else None."""
    text = " ".join(cmdline)
    return next((role for mark, role in ROLES if mark in text), None)


def cores_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  seconds: float) -> dict[str, float]:
    """CPU used between two reads, in cores, summed by role; a process seen in only one read is left out."""
    out: dict[str, float] = {}
    if seconds <= 0:
        return out
    for pid, (role, cpu) in after.items():
        if pid in before and before[pid][0] == role:
            out[role] = round(out.get(role, 0.0) + max(0.0, cpu - before[pid][1]) / seconds, 3)
    return out


def thread_cores(before: dict[int, float], after: dict[int, float], seconds: float, top: int = 3) -> list[float]:
    """The busiest threads' CPU between two reads (thread id → CPU seconds), in cores, most first: the engine core's
    busy loop and the threads that move its inputs and outputs share one interpreter lock, and how the process's one
    core splits between them is what a slow pass and a fast one may differ in."""
    if seconds <= 0:
        return []
    used = [max(0.0, cpu - before[tid]) / seconds for tid, cpu in after.items() if tid in before]
    return [round(c, 3) for c in sorted(used, reverse=True)[:top]]


ITL = "vllm:inter_token_latency_seconds"
"""vLLM's histogram of the time between a request's tokens: with answers of one length in decode, one engine step."""


def itl_totals(text: str) -> dict[str, float | None]:
    """vLLM's inter-token latency ``_sum`` and ``_count`` (summed over engines, models and API servers) from its
    Prometheus text: between two samples, their differences' ratio is the mean time between a request's tokens, the
    engine step's length — whether a slower server took longer per step or ran fewer per step. None where absent."""
    # imported here: pin.py, run where the package is not on the path, imports this module too
    from timeslice_verl.batch.concurrency import metric_values

    got: dict[str, float | None] = {"itl_sum": None, "itl_count": None}
    for name, value in metric_values(text):
        key = {f"{ITL}_sum": "itl_sum", f"{ITL}_count": "itl_count"}.get(name)
        if key is not None:
            got[key] = (got[key] or 0.0) + value
    return got


def _gpu(index: int) -> Any:
    try:
        import pynvml
    except ImportError as exc:
        log.info("no GPU clock samples: %s", exc)
        return None
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as exc:  # no driver (a CPU machine) or no such GPU: the GPU fields stay None
        log.info("no GPU clock samples: %s", exc)
        return None


class HostLoad:
    """Samples since the previous call: host CPU busy share, vLLM's processes' cores by role, GPU SM clock (MHz) and
    utilisation (%). The vLLM processes are looked for again every ``rescan`` samples (a restarted server).
    ``engine_pid``: the engine core whose CPU and threads are followed (the tenant's, :func:`engine_profile.
    engine_core_pid`); without it, the first of this user's found, kept while it lives. ``speed_cpu``: a CPU whose
    pace is read too (:class:`cpuspeed.SpeedProbe`, ``cpu_speed`` and ``cpu_rate``); :meth:`close` ends its probe."""

    def __init__(self, gpu_index: int = 0, rescan: int = 20, engine_pid: int | None = None,
                 speed_cpu: int | None = None) -> None:
        self._rescan, self._n, self._engine = rescan, 0, engine_pid
        self._speed = SpeedProbe(speed_cpu) if speed_cpu is not None else None
        self._pids: dict[int, str] = {}
        self._times, self._per_cpu = psutil.cpu_times(), psutil.cpu_times(percpu=True)
        self._procs, self._at = self._read(), time.monotonic()
        self._threads = (self._engine_pid(), self._engine_threads())
        self._nvml = _gpu(gpu_index)

    def _scan(self) -> None:
        self._pids = {}
        for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
            uids = proc.info.get("uids")
            if uids is not None and uids.real != os.getuid():
                continue
            role = vllm_role(proc.info.get("cmdline") or [])
            if role is not None:
                self._pids[proc.info["pid"]] = role

    def _engine_core_cpu(self, per_cpu: list[Any]) -> dict[str, Any]:
        """The engine core's CPU now, the share of it the hypervisor took since the last sample, and how busy the
        other threads of its physical core were (their mean; None without SMT). Where it moved in between, the
        figures are of the CPU it is on now."""
        cpu = self._engine_cpu()
        out: dict[str, Any] = {"engine_cpu": cpu, "engine_cpu_steal": None, "engine_mates_busy": None}
        if cpu is None or cpu >= min(len(per_cpu), len(self._per_cpu)):
            return out
        out["engine_cpu_steal"] = cpu_share(self._per_cpu[cpu], per_cpu[cpu])[1]
        mates = [cpu_share(self._per_cpu[c], per_cpu[c])[0] for c in core_mates(cpu) if c < len(per_cpu)]
        mates = [m for m in mates if m is not None]
        out["engine_mates_busy"] = round(sum(mates) / len(mates), 4) if mates else None
        return out

    def _read(self) -> dict[int, tuple[str, float]]:
        if self._n % self._rescan == 0:
            self._scan()
        self._n += 1
        out = {}
        for pid, role in self._pids.items():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:  # it ended: the next scan drops it
                continue
            out[pid] = (role, t.user + t.system)
        return out

    def _engine_pid(self) -> int | None:
        """The engine core followed: the one named, else the one followed so far while it lives, else this user's
        first (another copy of a test suite may run one too: a choice that stays put)."""
        if self._engine is None or (self._engine not in self._pids and not psutil.pid_exists(self._engine)):
            self._engine = next((pid for pid, role in self._pids.items() if role == "engine_core"), None)
        return self._engine

    def _engine_threads(self) -> dict[int, float]:
        """The engine core's threads' CPU seconds so far (none, or it ended: empty)."""
        pid = self._engine_pid()
        try:
            return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()} if pid else {}
        except psutil.Error:
            return {}

    def _engine_cpu(self) -> int | None:
        """The CPU the engine core ran on last (None: none, or it ended)."""
        pid = self._engine_pid()
        try:
            return psutil.Process(pid).cpu_num() if pid else None
        except (psutil.Error, AttributeError):  # ended (the next scan drops it), or no cpu_num here
            return None

    def sample(self) -> dict[str, Any]:
        times, per_cpu = psutil.cpu_times(), psutil.cpu_times(percpu=True)
        procs, now = self._read(), time.monotonic()
        out: dict[str, Any] = {"host_cpu": busy_share(host_busy(self._times), host_busy(times)),
                               "vllm_cores": cores_by_role(self._procs, procs, now - self._at),
                               "sm_mhz": None, "gpu_util": None, "steal": cpu_share(self._times, times)[1]}
        out["cpu_speed"], out["cpu_rate"] = self._speed.latest() if self._speed is not None else (None, None)
        out.update(self._engine_core_cpu(per_cpu))
        threads = (self._engine_pid(), self._engine_threads())  # compared only with the same process's
        out["engine_threads"] = thread_cores(self._threads[1], threads[1], now - self._at) \
            if threads[0] == self._threads[0] else []
        self._procs, self._at, self._times, self._per_cpu, self._threads = procs, now, times, per_cpu, threads
        if self._nvml is not None:
            nvml, handle = self._nvml
            try:
                out["sm_mhz"] = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
                out["gpu_util"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except nvml.NVMLError as exc:
                log.info("GPU clock sample failed: %s", exc)
        return out

    def close(self) -> None:
        if self._speed is not None:
            self._speed.close()
