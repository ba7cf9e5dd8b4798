"""deploy/: every manifest validates offline against the Kubernetes schemas, the timeslice settings in
them compose, the guide's commands name what is there, and the agent's container doctor says what a pod lacks."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from timeslice_verl.tools.container import check_host_pid, container_checks
from timeslice_verl.config.overrides import compose

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
GUIDE = ROOT / "guides" / "kubernetes.md"
KUBERNETES = "1.33.0"

kv = pytest.importorskip("kubernetes_validate", reason="the test extra installs kubernetes-validate")


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> dict:
    return next(doc for _, doc in documents() if doc["kind"] == kind)


def _validate(doc: dict) -> None:
    if doc["kind"] == "RayJob":  # a custom resource: its fields by our schema, its pods by Kubernetes'
        import jsonschema

        jsonschema.validate(doc, json.loads((K8S / "schema" / "rayjob.schema.json").read_text()))
        cluster = doc["spec"]["rayClusterSpec"]
        for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
            kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                        KUBERNETES, strict=True)
        return
    kv.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("name, doc", documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_the_kubernetes_schemas(name, doc):
    _validate(doc)


def test_a_wrong_field_is_caught():
    daemonset = _by_kind("DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # a typo of hostPID
    with pytest.raises(kv.ValidationError):
        _validate(daemonset)
    rayjob = _by_kind("RayJob")
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        _validate(rayjob)
    rayjob = _by_kind("RayJob")
    rayjob["spec"]["entryPoint"] = "python3 -m x"
    with pytest.raises(Exception, match="entryPoint"):
        _validate(rayjob)


def _agent_container(doc: dict) -> dict:
    return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")


def test_the_agents_settings_compose_and_match_the_rest():
    agent = _agent_container(_by_kind("DaemonSet"))
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in agent["args"]]
    settings = compose("interleave", args)
    assert str(settings.agent.socket) == "/run/timeslice-verl/agent.sock"
    assert settings.agent.metrics_port == int(agent["ports"][0]["containerPort"])
    service = next(doc for _, doc in documents() if doc["kind"] == "Service")
    assert settings.tenant.url == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:" \
                                  f"{service['spec']['ports'][0]['port']}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert agent[probe]["exec"]["command"][:2] == ["timeslice-verl", "status"]
        assert f"timeslice.agent.socket={settings.agent.socket}" in agent[probe]["exec"]["command"]
    pod = _by_kind("DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in pod["containers"])
    tenant = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    visible = next(e["value"] for e in tenant["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES")
    assert [int(visible)] == settings.agent.gpus, "the tenant lives on the GPU the agent arbitrates"


def test_the_rayjobs_settings_compose_and_reach_the_agents_socket():
    rayjob = _by_kind("RayJob")
    words = shlex.split(rayjob["spec"]["entrypoint"])  # Ray runs the entrypoint through a shell
    ours = [w for w in words if w.lstrip("+").startswith("timeslice")]
    assert "+timeslice=interleave" in ours
    settings = compose("interleave", ours)
    assert settings.tenant.url == "" and settings.plugins.disabled == []
    agent = compose("interleave", [a.replace("$(POD_IP)", "10.0.0.7") for a in _agent_container(_by_kind("DaemonSet"))["args"]])
    assert settings.agent.socket == agent.agent.socket
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in worker["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["volumes"]}
    socket_dir = str(Path(settings.agent.socket).parent)
    assert volumes[mounts[socket_dir]]["hostPath"]["path"] == socket_dir
    assert rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_the_guide_names_every_file_and_its_commands_match_the_manifests():
    guide = GUIDE.read_text()
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix != ".json"}
    named = set(re.findall(r"deploy/[\w./-]+\.(?:yaml|Dockerfile)", guide))
    assert named == files, (named ^ files)
    for command in re.findall(r"^timeslice-verl config .*$", guide, re.M):
        compose("interleave", shlex.split(command)[2:])
    label = next(iter(_by_kind("DaemonSet")["spec"]["template"]["spec"]["nodeSelector"].items()))
    assert f"{label[0]}={label[1]}" in guide
    for _, doc in documents():
        if doc["kind"] in ("Deployment", "DaemonSet", "RayJob", "Namespace"):
            assert doc["metadata"]["name"] in guide, doc["metadata"]["name"]


# --------------------------------------------------------------------------- the container doctor


def _proc(tmp_path: Path, pid1_comm: str, pid1_cgroup: str, self_cgroup: str) -> Path:
    for pid, comm, cgroup in (("1", pid1_comm, pid1_cgroup), ("self", "python3", self_cgroup)):
        (tmp_path / "proc" / pid).mkdir(parents=True)
        (tmp_path / "proc" / pid / "comm").write_text(comm + "\n")
        (tmp_path / "proc" / pid / "cgroup").write_text(cgroup + "\n")
    return tmp_path / "proc"


def test_host_pid_is_recognised_and_its_absence_said_in_plain_words(tmp_path):
    pod = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"
    host = check_host_pid(_proc(tmp_path / "host", "systemd", "0::/init.scope", pod))
    assert host.ok
    own = check_host_pid(_proc(tmp_path / "own", "timeslice-verl", pod, pod))
    assert not own.ok
    assert "set hostPID: true" in own.fix and "sees only its own processes" in own.detail


def test_the_agent_refuses_to_start_saying_what_its_pod_lacks(tmp_path):
    from click.testing import CliRunner

    from timeslice_verl.tools.cli import main

    socket = tmp_path / "not-mounted" / "agent.sock"
    result = CliRunner().invoke(main, ["agent", "--doctor-first", f"timeslice.agent.socket={socket}",
                                       "timeslice.tenant.url="])
    assert result.exit_code == 1
    assert f"FAIL  socket directory shared with the trainer pods — {socket.parent} does not exist" in result.output
    assert "mount a hostPath directory" in result.output
    assert "not starting" in result.output
    assert not socket.parent.exists(), "the agent did not start (it would have made the directory)"


def test_the_container_doctor_names_nvml_and_the_runtime_when_the_gpu_is_not_visible(tmp_path, monkeypatch):
    import timeslice_verl.tools.doctor as doctor

    monkeypatch.setattr(doctor, "_nvml", lambda: (None, "NVMLError_LibraryNotFound: NVML Shared Library Not Found"))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    settings = compose("interleave", [f"timeslice.agent.socket={run / 'agent.sock'}"])
    proc = _proc(tmp_path, "timeslice-verl", "0::/kubepods/x", "0::/kubepods/x")
    checks = {c.name: c for c in container_checks(settings, proc)}
    assert checks["socket directory shared with the trainer pods"].ok
    assert not checks["host PID namespace (hostPID)"].ok
    nvml = checks["NVML reachable"]
    assert not nvml.ok and "NVIDIA_VISIBLE_DEVICES=all" in nvml.fix and "runtimeClassName: nvidia" in nvml.fix
    assert not checks["driver supports CUDA checkpoint (r570+)"].ok
    sigstop = compose("interleave", [f"timeslice.agent.socket={run / 'agent.sock'}", "timeslice.agent.backend=sigstop"])
    assert [c.name for c in container_checks(sigstop, proc)] == ["host PID namespace (hostPID)",
                                                                 "socket directory shared with the trainer pods"]
