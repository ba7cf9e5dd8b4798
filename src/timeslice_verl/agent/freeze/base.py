"""Freeze/thaw of a job's processes on top of four per-process primitives.

The order follows the CUDA checkpoint API's rules: **lock all, then checkpoint all** (no process
of the job makes CUDA calls while another one is being checkpointed, so NCCL peers do not wait on
a frozen partner) and **restore all, then unlock all**. Locks and unlocks go one process at a time
(milliseconds); checkpoints and restores of a job's processes run side by side (seconds each). Every
primitive call has a timeout. A failure part-way is unwound — restore what was checkpointed, unlock
what was locked — so the job ends either fully frozen or fully running; only when unwinding fails too
is the error marked as leaving the job inconsistent. GPU memory is read through NVML before and after
each freeze/thaw when available, to record what was frozen and to verify it left and came back.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from timeslice_verl.agent import procfs
from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.selection import Candidate, Left, select
from timeslice_verl.log import get_logger

log = get_logger("agent.freeze")

RESIDUAL_OK_BYTES = 512 * 1024**2
"""What a checkpointed process may still show in NVML without it counting as 'not freed'."""


class ProcState(str, enum.Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    GONE = "gone"


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (no driver, driver too old, binary missing)."""


class DriverTimeout(RuntimeError):
    pass


class FreezeError(RuntimeError):
    """A freeze that did not happen. ``refused``: nothing was touched (the precheck said no)."""

    def __init__(self, message: str, *, unwound: bool, refused: bool = False) -> None:
        super().__init__(message)
        self.unwound = unwound
        self.refused = refused


class FootprintError(RuntimeError):
    """A parked process still holds more GPU memory than it reported keeping."""


class ThawError(RuntimeError):
    def __init__(self, message: str, *, still_frozen: bool) -> None:
        super().__init__(message)
        self.still_frozen = still_frozen


class Primitives(Protocol):
    """Per-process operations a backend provides. Each may block; each raises on failure."""

    name: str
    frees_gpu_memory: bool
    checkpoints_cuda: bool
    """Whether ``checkpoint`` moves CUDA state (the driver's restore rules apply)."""
    description: str

    def lock(self, pid: int, timeout_s: float) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def state(self, pid: int) -> ProcState: ...


def _gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 and nbytes else 0.0


@dataclass
class FreezeReport:
    pids: list[int]
    bytes: int = 0
    """GPU bytes the processes used before the freeze (NVML; 0 without it)."""
    residual_bytes: int = 0
    lock_s: float = 0.0
    check_s: float = 0.0
    """The NVML footprint check after a park's lock."""
    checkpoint_s: float = 0.0
    total_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return _gb_per_s(self.bytes, self.checkpoint_s)


@dataclass
class ThawReport:
    pids: list[int]
    bytes: int = 0
    """GPU bytes the processes use after the thaw (NVML; 0 without it)."""
    restore_s: float = 0.0
    unlock_s: float = 0.0
    total_s: float = 0.0
    restored: list[int] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return _gb_per_s(self.bytes, self.restore_s) if self.restored else 0.0  # an unlock moves nothing


class FreezeBackend:
    """Freeze and thaw a job's processes with ``primitives``; find them by tag (and NVML)."""

    def __init__(self, primitives: Primitives, *, probe: NvmlProbe | None, driver_timeout_s: float) -> None:
        self.primitives = primitives
        self.probe = probe
        self.timeout_s = driver_timeout_s if driver_timeout_s > 0 else None
        # one thread per process of a job at once (checkpoints run side by side), with room to spare for
        # calls that hung past their timeout and still hold a thread; threads start only when needed
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="ts-driver")
        self._warned_namespace = False
        self.only_on_gpus = True
        """Freeze only processes NVML places on the agent's GPUs (``timeslice.agent.freeze_off_gpu`` clears it)."""
        self._ident: dict[int, int | None] = {}
        self._told: set[tuple[int, int | None, Left]] = set()
        """Processes left running that were logged (pid, start time, why): each is logged once."""

    @property
    def name(self) -> str:
        return self.primitives.name

    @property
    def frees_gpu_memory(self) -> bool:
        return self.primitives.frees_gpu_memory

    @property
    def description(self) -> str:
        return self.primitives.description

    # ------------------------------------------------------------------ discovery

    def discover(self, job: str, registered: list[int], exclude: set[int] = frozenset(), uid: int | None = None) -> list[int]:
        """The job's processes to freeze (:func:`~timeslice_verl.agent.selection.select`): its registered trainer
        ranks, or without any its tagged processes, leaders only, on the agent's GPUs.

        Tagged processes count only when owned by ``uid`` (the job's client; default: the agent's own
        user): as root, the agent never freezes another user's process that happens to carry the tag.
        Each process left running is logged once (debug), with why."""
        owner = os.getuid() if uid is None else uid
        tagged = set(procfs.tagged_processes(job))
        ranks = {p for p in registered if procfs.identify(p) is not None and procfs.is_thread_group_leader(p)}
        gpu_pids = self._gpu_pids()
        chosen = select(Candidate(pid, title=procfs.title(pid), registered=pid in ranks, tagged=pid in tagged,
                                  owner_ok=pid in ranks or procfs.uid_of(pid) == owner,
                                  on_gpu=gpu_pids is None or pid in gpu_pids, client=pid in exclude)
                        for pid in tagged | ranks)
        for c, why in chosen.left:
            told = (c.pid, procfs.start_time(c.pid), why)
            if told not in self._told:
                self._told.add(told)
                log.debug("job %s: pid %d (%s) is not frozen: %s", job, c.pid, c.title or "?", why)
        return list(chosen.freeze)

    def _gpu_pids(self) -> set[int] | None:
        """The pids NVML places on the agent's GPUs, or None where no GPU filter applies (no NVML, a backend that
        frees no GPU memory, ``freeze_off_gpu``, or NVML's pids are not this agent's to see)."""
        if self.probe is None or not self.primitives.frees_gpu_memory or not self.only_on_gpus:
            return None
        gpu_pids = set(self.probe.process_memory())
        if gpu_pids and not any(procfs.identify(p) is not None for p in gpu_pids):
            if not self._warned_namespace:
                self._warned_namespace = True
                log.warning("NVML reports PIDs this agent cannot see (PID namespace?): using tagged processes")
            return None
        return gpu_pids

    # ------------------------------------------------------------------ the sequences

    def _remember(self, pids: list[int], identities: dict[int, int] | None) -> None:
        """Record who each pid is (its start time), checked again before every driver call."""
        self._ident = {pid: (identities or {}).get(pid, procfs.start_time(pid)) for pid in pids}

    def _submit(self, what: str, pid: int, fn: Callable[[], None]) -> concurrent.futures.Future:
        expected = self._ident.get(pid)
        if expected is not None and procfs.start_time(pid) != expected:
            raise ProcessLookupError(f"pid {pid} is no longer the process the agent recorded (it exited or the pid "
                                     f"was reused): no {self.name} {what}")
        return self._pool.submit(fn)

    def _timeout(self, what: str, pid: int) -> DriverTimeout:
        return DriverTimeout(f"{self.name} {what} of pid {pid} did not return within {self.timeout_s:g} s")

    def _timed(self, what: str, pid: int, fn: Callable[[], None]) -> None:
        try:
            self._submit(what, pid, fn).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(what, pid) from None

    def _each(self, what: str, pids: list[int], call: Callable[[int], None], done: list[int]) -> None:
        """``call`` on every pid at once, one driver thread each: ranks on different GPUs move their
        memory side by side instead of one after the other. ``done`` gets the pids that succeeded (in
        ``pids`` order) once every call returned or timed out; then the first error is raised."""
        futures: dict[int, concurrent.futures.Future] = {}
        error: BaseException | None = None
        for pid in pids:
            try:
                futures[pid] = self._submit(what, pid, lambda pid=pid: call(pid))
            except Exception as exc:
                error = exc
                break
        _, pending = concurrent.futures.wait(list(futures.values()), timeout=self.timeout_s)
        for pid, future in futures.items():
            failure = self._timeout(what, pid) if future in pending else future.exception()
            if failure is None:
                done.append(pid)
            elif error is None:
                error = failure
        if error is not None:
            raise error

    def _used(self, pids: list[int]) -> int:
        try:
            return self.probe.used_by(pids) if self.probe is not None else 0
        except Exception as exc:  # pragma: no cover - NVML hiccup
            log.warning("NVML query failed: %s", exc)
            return 0

    def precheck(self, pids: list[int], *, lock_only: bool = False) -> list[int]:
        """The live ``pids``, or :class:`FreezeError` (``refused``, nothing touched) for any process a
        freeze could not undo: one the driver does not report as running (already locked or
        checkpointed by someone else, or failed), or one whose NCCL could block its restore."""
        states = self.states(pids)
        live = [p for p in pids if states[p] != ProcState.GONE]
        odd = {p: states[p].value for p in live if states[p] != ProcState.RUNNING}
        if odd:
            raise FreezeError(
                f"refusing to freeze: the driver reports {odd} (only running processes are frozen; "
                "another tool may be checkpointing them)", unwound=True, refused=True,
            )
        if getattr(self.primitives, "checkpoints_cuda", False) and not lock_only:  # a lock maps nothing
            hazards = [h for h in (procfs.nccl_p2p_hazard(p) for p in live) if h]
            if hazards:
                raise FreezeError(f"refusing to freeze: {hazards[0]}", unwound=True, refused=True)
        return live

    def freeze(
        self, pids: list[int], identities: dict[int, int] | None = None, *, lock_only: bool = False,
        limits: dict[int, int] | None = None,
    ) -> FreezeReport:
        """Precheck, lock all, then checkpoint all. On failure, unwind and raise :class:`FreezeError`.

        ``identities`` (pid → start time, when the caller recorded them) guard every driver call
        against a pid that was reused meanwhile; without them the start times are read now.
        ``lock_only`` (the job's workers parked their tensors themselves): lock, never checkpoint.
        ``limits`` (pid → bytes): after the lock, NVML must show each process within its limit — the
        proof that a park really freed the GPU — or the locks are undone and the freeze is refused."""
        self._remember(pids, identities)
        pids = self.precheck(pids, lock_only=lock_only)
        report = FreezeReport(pids=list(pids), bytes=self._used(pids))
        t0 = time.perf_counter()
        locked: list[int] = []
        checkpointed: list[int] = []
        lock_timeout = self.timeout_s or 0.0
        try:
            for pid in pids:
                self._timed("lock", pid, lambda pid=pid: self.primitives.lock(pid, lock_timeout))
                locked.append(pid)
            t1 = time.perf_counter()
            report.lock_s = t1 - t0
            if limits is not None:
                self._check_footprint(pids, limits)
                report.check_s = time.perf_counter() - t1
                t1 += report.check_s
            if not lock_only:
                self._each("checkpoint", pids, self.primitives.checkpoint, checkpointed)
            report.checkpoint_s = 0.0 if lock_only else time.perf_counter() - t1
        except Exception as exc:
            problems = self._unwind(locked, checkpointed)
            if problems:
                raise FreezeError(f"{exc}; unwinding failed too: {'; '.join(problems)}", unwound=False) from exc
            refused = isinstance(exc, FootprintError)  # nothing was moved: the job keeps the GPU
            raise FreezeError(f"{exc} (unwound: the job's processes run again)", unwound=True, refused=refused) from exc
        report.total_s = time.perf_counter() - t0
        report.residual_bytes = self._used(pids)
        if self.probe is not None and self.frees_gpu_memory and not lock_only and report.residual_bytes > RESIDUAL_OK_BYTES:
            log.warning(
                "after checkpoint NVML still shows %.2f GiB for pids %s (was %.2f GiB)",
                report.residual_bytes / 2**30, pids, report.bytes / 2**30,
            )
        return report

    def _check_footprint(self, pids: list[int], limits: dict[int, int]) -> None:
        """Each locked process within its byte limit by NVML (skipped without NVML: nothing to read)."""
        if self.probe is None or not self.frees_gpu_memory:
            return
        usage = self.probe.process_memory()
        over = {pid: usage.get(pid, 0) for pid in pids if usage.get(pid, 0) > limits.get(pid, 0)}
        if over:
            pid, used = next(iter(over.items()))
            raise FootprintError(
                f"refusing to lend the GPU: pid {pid} still uses {used / 2**30:.2f} GiB after its park (at most "
                f"{limits.get(pid, 0) / 2**30:.2f} GiB expected: what it kept plus timeslice.agent.park_overhead_gib); "
                f"over the limit: {sorted(over)}"
            )

    def _unwind(self, locked: list[int], checkpointed: list[int]) -> list[str]:
        problems = []
        for pid in reversed(checkpointed):
            try:
                self._timed("restore", pid, lambda pid=pid: self.primitives.restore(pid))
            except Exception as exc:
                problems.append(f"restore of pid {pid}: {exc}")
        for pid in reversed(locked):
            try:
                self._timed("unlock", pid, lambda pid=pid: self.primitives.unlock(pid))
            except Exception as exc:
                problems.append(f"unlock of pid {pid}: {exc}")
        return problems

    def thaw(self, pids: list[int], identities: dict[int, int] | None = None) -> ThawReport:
        """Restore all checkpointed, then unlock all locked. Gone processes are skipped."""
        self._remember(pids, identities)
        report = ThawReport(pids=list(pids))
        t0 = time.perf_counter()
        states = self.states(pids)
        try:
            self._each("restore", [p for p in pids if states[p] == ProcState.CHECKPOINTED], self.primitives.restore,
                       report.restored)
            t1 = time.perf_counter()
            report.restore_s = t1 - t0
            for pid in pids:
                if states[pid] in (ProcState.CHECKPOINTED, ProcState.LOCKED):
                    self._timed("unlock", pid, lambda pid=pid: self.primitives.unlock(pid))
            report.unlock_s = time.perf_counter() - t1
        except Exception as exc:
            # Put the restored ones back, so the job is consistently frozen (its memory stays in host RAM).
            rewound = True
            for pid in reversed(report.restored):
                try:
                    self._timed("checkpoint", pid, lambda pid=pid: self.primitives.checkpoint(pid))
                except Exception as again:
                    rewound = False
                    log.error("could not re-checkpoint pid %d after a failed thaw: %s", pid, again)
            raise ThawError(f"{exc}", still_frozen=rewound) from exc
        report.total_s = time.perf_counter() - t0
        report.bytes = self._used(pids)
        return report

    def states(self, pids: list[int]) -> dict[int, ProcState]:
        out = {}
        for pid in pids:
            if procfs.state_char(pid) is None:
                out[pid] = ProcState.GONE
                continue
            try:
                out[pid] = self.primitives.state(pid)
            except Exception as exc:
                log.warning("state of pid %d: %s", pid, exc)
                out[pid] = ProcState.FAILED
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
