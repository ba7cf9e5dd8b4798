# The snapshot agent's image: the core of timeslice-verl on a slim Python (no torch, no verl, no vLLM).
# The NVIDIA container runtime mounts the driver's libcuda.so.1 and NVML into it at run time.
#   docker build -f deploy/images/agent.Dockerfile -t REGISTRY/timeslice-verl/agent:VERSION .
FROM docker.io/library/python:3.12-slim
COPY . /src/timeslice-verl
RUN pip install --no-cache-dir /src/timeslice-verl && rm -rf /src/timeslice-verl
# The agent runs as root (uid 0) so that it may lock and checkpoint the trainer's processes, which run as
# root in verl's images; the pod drops every capability but SYS_PTRACE (deploy/k8s/agent-daemonset.yaml).
ENV PYTHONUNBUFFERED=1
# --doctor-first: check hostPID, the socket directory, NVML and the driver, and refuse to start, in plain
# words, when the pod lacks one of them.
ENTRYPOINT ["timeslice-verl", "agent", "--doctor-first"]
