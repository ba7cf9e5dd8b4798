"""What the agent needs from its container, checked before it starts (``timeslice-verl agent --doctor-first``).

In Kubernetes the agent runs in a DaemonSet pod beside the trainer's Ray pods and the vLLM tenant. It
can only do its job if the pod was given:

* the **host's PID namespace** (``hostPID: true``): the trainer's processes live in other containers,
  and the agent finds them by their ``TIMESLICE_JOB`` tag in ``/proc`` and freezes them by host PID (the
  PIDs NVML reports);
* the **socket directory** the trainer pods mount too (a ``hostPath``), private to the agent's user;
* the **GPUs**, visible to NVML (``NVIDIA_VISIBLE_DEVICES=all`` with the NVIDIA container runtime,
  without requesting ``nvidia.com/gpu`` so the scheduler keeps them for the trainer), and the driver's
  checkpoint API (``libcuda.so.1``) for the CUDA backend.

Each check says in plain words what is missing and how to give it.
"""

from __future__ import annotations

import os
from pathlib import Path

from timeslice_verl.config.schema import TimesliceSettings, socket_path
from timeslice_verl.tools.doctor import Check, check_driver, check_nvml

HOST_INIT = {"systemd", "init"}
"""What PID 1 is called in a host's PID namespace (a container's PID 1 is its own entrypoint or pause)."""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def check_host_pid(proc: Path = Path("/proc")) -> Check:
    """The pod shares the host's PID namespace: PID 1 is the host's init, not this container's entrypoint."""
    name = "host PID namespace (hostPID)"
    comm = _read(proc / "1" / "comm")
    cgroup1, cgroup_self = _read(proc / "1" / "cgroup"), _read(proc / "self" / "cgroup")
    host_init = comm in HOST_INIT or any(line.endswith(("::/", "::/init.scope")) for line in cgroup1.splitlines())
    same_container = bool(cgroup1) and cgroup1 == cgroup_self
    ok = host_init and not same_container
    detail = f"PID 1 is {comm or 'unreadable'!r}" + ("" if ok else ", so this container sees only its own processes")
    return Check(name, ok, detail, "" if ok else "set hostPID: true in the agent's pod spec: the trainer's processes "
                 "run in other containers and the agent must see and freeze them by their host PIDs")


def check_socket_dir(settings: TimesliceSettings) -> Check:
    """The socket's directory exists (the hostPath the trainer pods mount too), and only this user can write it."""
    path = socket_path(settings)
    parent = path.parent
    name = "socket directory shared with the trainer pods"
    fix = (f"mount a hostPath directory at {parent} in the agent's pod and in every trainer pod "
           f"(type DirectoryOrCreate), owned by the agent's user and not writable by others")
    if not parent.is_dir():
        return Check(name, False, f"{parent} does not exist in this container", fix)
    st = parent.stat()
    if st.st_uid != os.getuid():
        return Check(name, False, f"{parent} belongs to uid {st.st_uid}, the agent runs as uid {os.getuid()}", fix)
    if st.st_mode & 0o022:
        return Check(name, False, f"{parent} is writable by others (mode {st.st_mode & 0o777:o})",
                     f"chmod 0700 {parent} (an init container can do it), or use a private directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        return Check(name, False, f"{parent} is not writable here (read-only mount?)", fix)
    return Check(name, True, f"{parent} (mode {st.st_mode & 0o777:o}, uid {st.st_uid})")


def container_checks(settings: TimesliceSettings, proc: Path = Path("/proc")) -> list[Check]:
    """What the agent itself needs in its pod (the tenant and the trainer come later and are not checked)."""
    gpu = [check_nvml()] + ([check_driver()] if str(settings.agent.backend) == "cuda" else [])
    if str(settings.agent.backend) == "sigstop":
        gpu = []  # the CPU test backend needs no GPU
    for check in gpu:
        if not check.ok:
            check.fix = (f"{check.fix}; in a pod: run it with the NVIDIA container runtime (runtimeClassName: nvidia) "
                         "and the env NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=compute,utility, without "
                         "requesting nvidia.com/gpu (the trainer keeps its GPUs)")
    return [check_host_pid(proc), check_socket_dir(settings), *gpu]


__all__ = ["check_host_pid", "check_socket_dir", "container_checks"]
