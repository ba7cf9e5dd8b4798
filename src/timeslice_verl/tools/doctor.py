"""``timeslice-verl doctor``: is this node ready to time-slice? Each check PASS/FAIL with the fix."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import httpx

from timeslice_verl.agent import procfs
from timeslice_verl.agent.gpu import nvml
from timeslice_verl.config.schema import JOB_TAG_ENV, NCCL_ENV, TimesliceSettings, socket_path
from timeslice_verl.handoff.swap_choice import agent_figures, parkable, resident_room
from timeslice_verl.names import swap_setting
from timeslice_verl.ranks.worker import host_available

MIN_DRIVER = 570


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _nvml() -> tuple[object | None, str]:
    return nvml()


def check_nvml() -> Check:
    nvml, err = _nvml()
    if nvml is None:
        return Check("NVML reachable", False, err or "NVML did not initialise",
                     "install the NVIDIA driver (NVML ships with it) and run on a machine with a GPU")
    count = nvml.nvmlDeviceGetCount()  # type: ignore[attr-defined]
    return Check("NVML reachable", count > 0, f"{count} GPU(s)", "" if count else "no GPU is visible (CUDA_VISIBLE_DEVICES?)")


def check_driver() -> Check:
    nvml, err = _nvml()
    if nvml is None:
        return Check("driver supports CUDA checkpoint (r570+)", False, f"cannot read the driver version: {err}",
                     f"install NVIDIA driver {MIN_DRIVER} or newer")
    version = nvml.nvmlSystemGetDriverVersion()  # type: ignore[attr-defined]
    version = version.decode() if isinstance(version, bytes) else str(version)
    major = int(version.split(".")[0])
    ok = major >= MIN_DRIVER
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        api = all(hasattr(lib, f) for f in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                            "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"))
    except OSError:
        api = False
    return Check("driver supports CUDA checkpoint (r570+)", ok and api,
                 f"driver {version}; cuCheckpointProcess* {'present' if api else 'missing'} in libcuda.so.1",
                 "" if ok and api else f"upgrade the NVIDIA driver to {MIN_DRIVER} or newer")


def check_nccl_env(settings: TimesliceSettings) -> list[Check]:
    """What the job's workers run with (the option sets it for them, not for this shell)."""
    wanted = ", ".join(f"{k}={v}" for k, v in NCCL_ENV.items())
    fix = ("launch the job with +timeslice=interleave (it sets them through "
           "ray_kwargs.ray_init.runtime_env.env_vars) or export them in the job's environment")
    pids = procfs.tagged_processes(settings.job)
    if not pids:
        return [Check(f"NCCL settings of job {settings.job!r}", True,
                      f"no process tagged {JOB_TAG_ENV}={settings.job} is running; +timeslice=interleave gives verl's workers {wanted}")]
    out = []
    for pid in pids:
        env = procfs.environ(pid) or {}
        wrong = {k: env.get(k) for k, v in NCCL_ENV.items() if env.get(k) != v}
        detail = "; ".join(f"{k}={v!r}" if v is not None else f"{k} unset" for k, v in wrong.items()) or wanted
        hazard = procfs.nccl_p2p_hazard(pid)
        out.append(Check(f"NCCL settings of pid {pid} (job {settings.job!r})", not wrong,
                         detail + (" (the agent will refuse to freeze it: P2P on)" if hazard else ""), fix if wrong else ""))
    return out


def check_vllm(settings: TimesliceSettings) -> list[Check]:
    """Each tenant server (one, or one per GPU with ``timeslice.tenant.urls``) follows the contract."""
    urls = settings.tenant.urls
    if not urls:
        return [Check("batch tenant", True, "none configured (timeslice.tenant.urls is empty): the trainer's valleys stay idle")]
    return [_check_one_vllm(url, "" if len(urls) == 1 else f" ({url})") for url in urls]


def _check_one_vllm(url: str, which: str) -> Check:
    name = f"vLLM reachable with dev mode + sleep mode{which}"
    fix = ("start vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode, e.g. "
           "timeslice-verl tenant run -- vllm serve MODEL --port 8000 (it sets both)")
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            client.get("/health").raise_for_status()
            sleeping = client.get("/is_sleeping")
            if sleeping.status_code == 404:
                return Check(name, False, f"{url} answers but has no /is_sleeping (dev mode or sleep mode off)", fix)
            sleeping.raise_for_status()
            version = client.get("/version")
    except httpx.HTTPError as exc:
        return Check(name, False, f"{url}: {type(exc).__name__}: {exc}", fix)
    state, v = _json_field(sleeping, "is_sleeping"), _json_field(version, "version") if version.is_success else "?"
    if state is None:  # a proxy's error page, another server on the port: not vLLM's answer
        return Check(name, False, f"{url}/is_sleeping answered {_shown(sleeping.text)} (not vLLM's JSON)", fix)
    return Check(name, True, f"vLLM {_shown(str(v or '?'))} at {url}, is_sleeping={state}")


def _json_field(resp: httpx.Response, key: str) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get(key) if isinstance(body, dict) else None


def _shown(text: str, most: int = 80) -> str:
    """A server's text as a terminal can show it: control characters escaped, cut short."""
    return repr(text[:most]) if any(not ch.isprintable() for ch in text[:most]) else f"'{text[:most]}'"


def check_agent(settings: TimesliceSettings) -> Check:
    from timeslice_verl.agent.client import AgentClient, AgentError

    path = socket_path(settings)
    try:
        with AgentClient(path, connect_timeout_s=1.0) as client:
            hello = client.hello()
    except AgentError as exc:
        return Check("agent socket reachable", False, exc.message,
                     f"start the agent: timeslice-verl agent timeslice.agent.socket={path}")
    return Check("agent socket reachable", True, f"agent {hello['agent_version']} pid {hello['pid']} backend {hello['backend']}")


def check_backend(settings: TimesliceSettings) -> Check:
    """The CPU test backend pauses processes and frees no GPU memory: never right on a GPU node."""
    name = "agent backend frees GPU memory"
    if settings.agent.backend == "sigstop":
        return Check(name, False, "timeslice.agent.backend=sigstop is the CPU test backend: it pauses the trainer "
                     "but frees no GPU memory", "use timeslice.agent.backend=cuda (or cuda-cli)")
    from timeslice_verl.agent.freeze import BackendUnavailable, make_backend

    try:  # loads what the agent would: libcuda.so.1 and its cuCheckpointProcess* (cuda), or the binary (cuda-cli)
        make_backend(settings.agent.backend, probe=None, driver_timeout_s=1.0,
                     cuda_checkpoint_bin=settings.agent.cuda_checkpoint_bin)
    except (BackendUnavailable, ValueError) as exc:
        return Check(name, False, f"timeslice.agent.backend={settings.agent.backend} cannot be used here: {exc}",
                     "run on the GPU node with NVIDIA driver r570+ (libcuda.so.1), or install cuda-checkpoint for cuda-cli")
    return Check(name, True, f"timeslice.agent.backend={settings.agent.backend}")


def check_host_ram(settings: TimesliceSettings) -> Check:
    name = "host RAM >= GPU bytes to freeze"
    nvml, err = _nvml()
    if nvml is None:
        return Check(name, False, f"cannot read GPU memory ({err})", "run on the GPU node")
    total = 0
    for i in settings.agent.gpus or range(int(nvml.nvmlDeviceGetCount())):  # type: ignore[attr-defined]
        try:
            total += int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).total)  # type: ignore[attr-defined]
        except Exception as exc:
            return Check(name, False, f"GPU {i}: {exc}", "fix timeslice.agent.gpus")
    avail = host_available()
    return Check(name, avail >= total, f"{avail / 2**30:.1f} GiB available for {total / 2**30:.1f} GiB of GPU memory",
                 "a frozen trainer's GPU memory lives in host RAM: free RAM or freeze fewer GPUs per node")


def check_park_room(settings: TimesliceSettings) -> Check:
    """How much trainer state ``park`` can pin here: what ``swap=auto`` decides by, in numbers."""
    name = "host RAM for park (pinned, the size of the trainer's GPU state)"
    avail = host_available()
    most = parkable(avail)
    detail = (f"{avail / 2**30:.1f} GiB available: swap=auto parks up to {most / 2**30:.1f} GiB of trainer state per node "
              f"(about {most / 16 / 1e9:.2f} B parameters with AdamW in fp32, 16 bytes each); "
              f"timeslice.handoff.swap={settings.handoff.swap}")
    swap = swap_setting(str(settings.handoff.swap))
    ok = not (swap and swap.parks) or most > 0
    return Check(name, ok, detail, "free host RAM, or use timeslice.handoff.swap=auto (checkpoint when park cannot fit)")


def check_swap_choice(settings: TimesliceSettings) -> Check:
    """What ``swap=auto`` picks here, by how much a rank keeps after releasing its caches (the trainer's log says
    what it picked, with the figures of the run)."""
    from timeslice_verl.agent.client import AgentClient, AgentError

    name = "swap=auto on this node"
    nvml, err = _nvml()
    if nvml is None:
        return Check(name, True, f"checkpoint: the GPUs' memory is unknown ({err})")
    gpu = settings.agent.gpus[0] if settings.agent.gpus else 0
    total = int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(gpu)).total)  # type: ignore[attr-defined]
    try:
        with AgentClient(socket_path(settings), connect_timeout_s=1.0) as client:
            tenant = agent_figures(client.status()).get("tenant_bytes", 0)
    except AgentError:
        tenant = 0
    park = parkable(host_available()) / 2**30
    if not tenant:
        return Check(name, True, f"the tenant's awake footprint is not measured yet (the agent's first yield does): until "
                     f"then park (up to {park:.1f} GiB of trainer state per node) or checkpoint")
    room = resident_room(total, tenant) / 2**30
    return Check(name, True, f"resident while a rank keeps at most {room:.1f} GiB after releasing its caches (GPU "
                 f"{total / 2**30:.0f} GiB, the tenant awake {tenant / 2**30:.1f} GiB); else park up to {park:.1f} GiB "
                 "of trainer state per node; else checkpoint")


def check_yield_by(settings: TimesliceSettings) -> Check:
    """How the tenant gives the GPU back: a pause alone (memory allowing) or pause and sleep, and why."""
    from timeslice_verl.agent.client import AgentClient, AgentError

    name, by = "tenant yields by", str(settings.tenant.yield_by)
    if by == "sleep":
        return Check(name, True, "pause and sleep at every yield (timeslice.tenant.yield_by=sleep)")
    try:
        with AgentClient(socket_path(settings), connect_timeout_s=1.0) as client:
            last = client.status().get("yield_by") or {}
    except AgentError:
        last = {}
    how = "a pause alone" if last.get("pause_only") else "pause and sleep"
    return Check(name, True, f"{how} at the last yield: {last['why']}" if last.get("why") else
                 "a pause alone once the trainer's measured peak and the tenant's awake memory fit the GPU with "
                 f"{settings.tenant.awake_margin_gib:g} GiB to spare (NVML measures them; the agent is not running)")


def run_checks(settings: TimesliceSettings) -> list[Check]:
    return [check_driver(), check_nvml(), check_backend(settings), *check_nccl_env(settings), *check_vllm(settings),
            check_agent(settings), check_host_ram(settings), check_park_room(settings), check_swap_choice(settings), check_yield_by(settings)]


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{'PASS' if c.ok else 'FAIL'}  {c.name} — {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"      fix: {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed}/{len(checks)} checks passed" + (f", {failed} failed" if failed else ""))
    return "\n".join(lines)
