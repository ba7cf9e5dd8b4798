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
    """Every Kubernetes object of deploy/k8s (the kustomization is kustomize's file, checked on its own)."""
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str, name: str | None = None) -> dict:
    return next(doc for _, doc in documents() if doc["kind"] == kind and name in (None, doc["metadata"]["name"]))


def _pod_specs() -> list[tuple[str, dict]]:
    """(object name, pod spec) of every pod the manifests make."""
    out = []
    for _, doc in documents():
        if doc["kind"] in ("DaemonSet", "Deployment"):
            out.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "RayJob":
            out += [(doc["metadata"]["name"], t["spec"]) for t in _ray_templates(doc)]
    return out


def _ray_templates(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster.get("workerGroupSpecs", [])),
            *([doc["spec"]["submitterPodTemplate"]] if "submitterPodTemplate" in doc["spec"] else [])]


def _validate(doc: dict) -> None:
    if doc["kind"] == "RayJob":  # a custom resource: its fields by KubeRay's, every pod template by Kubernetes'
        import jsonschema

        jsonschema.validate(doc, json.loads((K8S / "schema" / "rayjob.schema.json").read_text()))
        for template in _ray_templates(doc):
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
    assert settings.agent.gpus == [], "the agent arbitrates every GPU of its node"
    tenant = _by_kind("DaemonSet", "vllm-tenant")["spec"]["template"]["spec"]["containers"][0]
    assert "--gpu=auto" in tenant["args"], "the tenant starts on the GPU the agent sees the trainer on"
    assert f"--register-url={settings.tenant.url}" in tenant["args"]
    assert f"--set=timeslice.agent.socket={settings.agent.socket}" in tenant["args"]


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


KUBERAY_FIELDS = {
    "submissionMode": "HTTPMode", "activeDeadlineSeconds": 3600, "backoffLimit": 2, "suspend": True,
    "entrypointNumGpus": 0.5,
    "submitterPodTemplate": {"spec": {"restartPolicy": "Never", "containers": [{"name": "submit", "image": "r/i:1"}]}},
}


@pytest.mark.parametrize("where, field, value", [
    *(("spec", k, v) for k, v in KUBERAY_FIELDS.items()),
    ("worker", "numOfHosts", 2), ("cluster", "autoscalerOptions", {"idleTimeoutSeconds": 60}),
    ("head", "enableIngress", False),
])
def test_the_rayjob_check_accepts_what_kuberay_accepts(where, field, value):
    rayjob = _by_kind("RayJob")
    spec = rayjob["spec"]
    target = {"spec": spec, "cluster": spec["rayClusterSpec"], "head": spec["rayClusterSpec"]["headGroupSpec"],
              "worker": spec["rayClusterSpec"]["workerGroupSpecs"][0]}[where]
    target[field] = value
    _validate(rayjob)


@pytest.mark.parametrize("break_it", [
    lambda s: s["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(containers=[{"name": "x", "imagee": "i"}]),
    lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(resources="lots"),
    lambda s: s.update(submitterPodTemplate={"spec": {"containers": [{"name": "s", "image": "i", "ports": "8000"}]}}),
    lambda s: s.update(submissionMode="ShellMode"),
    lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].update(numOfHosts=0),
], ids=["unknown container field", "resources not an object", "submitter ports not a list", "no such mode", "no hosts"])
def test_the_rayjob_check_refuses_what_kuberay_or_kubernetes_refuses(break_it):
    import jsonschema

    rayjob = _by_kind("RayJob")
    break_it(rayjob["spec"])
    with pytest.raises((kv.ValidationError, jsonschema.ValidationError)):
        _validate(rayjob)


def test_pods_are_admitted_where_pod_security_taints_and_priorities_apply():
    labels = _by_kind("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged", "hostPID and hostPath break Baseline"
    classes = {doc["metadata"]["name"] for _, doc in documents() if doc["kind"] == "PriorityClass"}
    for name, pod in _pod_specs():
        assert pod.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}, name
        if pod.get("priorityClassName"):
            assert pod["priorityClassName"] in classes, f"{name}: a priority class outside kube-system must exist"
    for daemon in ("timeslice-agent", "vllm-tenant"):
        pod = _by_kind("DaemonSet", daemon)["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"], daemon
        assert pod["nodeSelector"] == {"timeslice.verl/gpu-node": "true"}, "the tenant runs on every agent's node"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["patches"][0]["target"] == {"kind": "DaemonSet"}, "the taint is one patch for both daemons"
    assert set(kustomization["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "rayjob.yaml"}


def test_the_tenant_waits_for_its_model_and_no_gpu_index_is_written_down():
    tenant = _by_kind("DaemonSet", "vllm-tenant")["spec"]["template"]["spec"]["containers"][0]
    startup = tenant["startupProbe"]
    assert startup["httpGet"]["path"] == "/health" and startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    text = "\n".join(p.read_text() for p in K8S.glob("*.yaml"))
    assert not re.search(r"gpus=\[\d|NVIDIA_VISIBLE_DEVICES\W+value: \"?\d|--gpu[= ]\d", text)


def test_images_are_registry_qualified_and_versioned_and_the_trainer_has_verl():
    images = [c["image"] for _, pod in _pod_specs() for c in pod.get("initContainers", []) + pod["containers"]]
    for image in images:
        registry, _, rest = image.partition("/")
        assert "." in registry and ":" in rest and not rest.endswith(":latest"), image
    for path in (ROOT / "deploy" / "images").glob("*.Dockerfile"):
        base = re.search(r"^ARG BASE=(\S+)|^FROM (\S+)", path.read_text(), re.M)
        name = base.group(1) or base.group(2)
        assert "/" in name and re.search(r":v?\d", name), f"{path.name}: {name} is not a versioned, qualified base"
    trainer = (ROOT / "deploy" / "images" / "trainer.Dockerfile").read_text()
    assert "[verl]" in trainer and re.search(r"ARG VERL=\d+\.\d+\.\d+", trainer)


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


def test_the_guide_starts_from_a_bare_cluster():
    guide = GUIDE.read_text()
    assert "## 1. Prerequisites" in guide and "kubectl get crd rayjobs.ray.io" in guide and "runtimeclass nvidia" in guide
    assert "kubectl -n timeslice wait --for=condition=Ready" in guide and "rollout status" not in guide
    for step in ("Build and push", "Install", "Upgrade", "Uninstall", "When something goes wrong"):
        assert f". {step}" in guide, step


def test_an_agent_told_every_gpu_of_a_node_without_nvml_refuses_to_start_saying_so(tmp_path):
    """``timeslice.agent.gpus=[]`` (the DaemonSet's) is resolved by NVML when the agent starts; without it, a clear error."""
    from click.testing import CliRunner

    from timeslice_verl.agent.gpu import node_gpus
    from timeslice_verl.tools.cli import main

    try:
        node_gpus()
        pytest.skip("NVML sees GPUs here: the refusal is for a node without them")
    except ValueError:
        pass
    result = CliRunner().invoke(main, ["agent", "timeslice.agent.gpus=[]", "timeslice.agent.backend=sigstop",
                                       f"timeslice.agent.socket={tmp_path / 'run' / 'agent.sock'}",
                                       f"timeslice.agent.state_file={tmp_path / 'run' / 'state.json'}",
                                       "timeslice.tenant.url="])
    assert result.exit_code != 0
    assert "timeslice.agent.gpus=[] means every GPU of the node, but NVML is unavailable" in result.output


# --------------------------------------------------------------------------- the cluster queue

CLUSTER = K8S / "cluster"


def _overlaid_tenant() -> dict:
    """The tenant DaemonSet as the cluster overlay makes it: its strategic-merge patch applied to the container it
    names (lists of containers merge by name; a container's command, args and env are replaced or merged by name)."""
    base = _by_kind("DaemonSet", "vllm-tenant")
    patch = yaml.safe_load((CLUSTER / "feeder.patch.yaml").read_text())
    assert (patch["kind"], patch["metadata"]["name"]) == ("DaemonSet", "vllm-tenant")
    for change in patch["spec"]["template"]["spec"]["containers"]:
        target = next(c for c in base["spec"]["template"]["spec"]["containers"] if c["name"] == change["name"])
        env = {e["name"]: e for e in target.get("env", [])}
        env.update({e["name"]: e for e in change.pop("env", [])})
        target.update(change)
        target["env"] = list(env.values())
    return base


def test_the_cluster_overlay_validates_and_its_settings_compose():
    kustomization = yaml.safe_load((CLUSTER / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["..", "batch-api.yaml"]
    assert [p["path"] for p in kustomization["patches"]] == ["feeder.patch.yaml"]
    api_docs = [d for d in yaml.safe_load_all((CLUSTER / "batch-api.yaml").read_text()) if d]
    tenant = _overlaid_tenant()
    for doc in [*api_docs, tenant]:
        _validate(doc)
    feeder = next(c for c in tenant["spec"]["template"]["spec"]["containers"] if c["name"] == "batch")
    api = api_docs[0]["spec"]["template"]["spec"]["containers"][0]
    for container, command in ((feeder, ["timeslice-verl", "batch", "feed"]),
                               (api, ["timeslice-verl", "batch", "serve", "--api-only"])):
        assert container["command"] == command
        settings = compose("interleave", [a.removeprefix("--set=") for a in container["args"]])
        assert str(settings.batch.store) == "postgresql" and not settings.batch.dsn_file
        env = {e["name"]: e for e in container["env"]}
        assert env["TIMESLICE_BATCH_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "timeslice-batch-dsn", "key": "dsn"}
        assert not any("postgresql://" in a for a in container["args"]), "the DSN never on a command line"
    service = api_docs[1]
    assert set(service["spec"]["selector"].items()) <= set(api_docs[0]["spec"]["template"]["metadata"]["labels"].items())
    guide = (ROOT / "guides" / "batch-cluster.md").read_text()
    for name in ("deploy/k8s/cluster/kustomization.yaml", "timeslice-batch-dsn", "CloudNativePG", "batch feed",
                 "--api-only"):
        assert name in guide, name
