"""CUDA driver API backend: ``cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState}``.

Called from the agent's own process through ``libcuda.so.1`` (ctypes: no CUDA toolkit or Python
binding needed, any r570+ driver). ``cuInit(0)`` runs first — restore needs an initialised driver
in the caller. The agent never creates a context, so it holds no GPU memory itself.
"""

from __future__ import annotations

import ctypes
import struct

from timeslice_verl.agent.freeze.base import BackendUnavailable, ProcState

_ARGS_BYTES = 256  # every *Args struct is 64 bytes today; zeroed room to spare for newer drivers
_STATES = {0: ProcState.RUNNING, 1: ProcState.LOCKED, 2: ProcState.CHECKPOINTED, 3: ProcState.FAILED}
_FUNCS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, pid: int, code: int, name: str) -> None:
        super().__init__(f"{call}(pid={pid}) failed: {name} ({code})")
        self.code = code


class CudaDriverPrimitives:
    name = "cuda"
    checkpoints_cuda = True
    frees_gpu_memory = True
    description = "CUDA driver checkpoint/restore (cuCheckpointProcess*)"

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as exc:
            raise BackendUnavailable(f"cannot load {library}: {exc} (is the NVIDIA driver installed?)") from None
        missing = [f for f in _FUNCS if not hasattr(self._lib, f)]
        if missing:
            raise BackendUnavailable(
                f"the driver lacks {', '.join(missing)}: CUDA checkpoint/restore needs driver r570 or newer"
            )
        for name in _FUNCS:
            getattr(self._lib, name).argtypes = [ctypes.c_int, ctypes.c_void_p]
            getattr(self._lib, name).restype = ctypes.c_int
        self._lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        rc = self._lib.cuInit(0)
        if rc != 0:
            raise BackendUnavailable(f"cuInit(0) failed: {self._error_name(rc)} ({rc})")

    def _error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return "CUDA_ERROR_UNKNOWN"

    def _call(self, func: str, pid: int, args: ctypes.Array | None) -> None:
        rc = getattr(self._lib, func)(pid, ctypes.cast(args, ctypes.c_void_p) if args is not None else None)
        if rc != 0:
            raise CudaDriverError(func, pid, rc, self._error_name(rc))

    def lock(self, pid: int, timeout_s: float) -> None:
        args = ctypes.create_string_buffer(_ARGS_BYTES)
        struct.pack_into("I", args, 0, max(0, min(int(timeout_s * 1000), 2**32 - 1)))
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.create_string_buffer(_ARGS_BYTES))

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid, ctypes.create_string_buffer(_ARGS_BYTES))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.create_string_buffer(_ARGS_BYTES))

    def state(self, pid: int) -> ProcState:
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value))  # type: ignore[arg-type]
        return _STATES.get(value.value, ProcState.FAILED)
