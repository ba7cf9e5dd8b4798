# The tenant's image: vLLM's release image (the version timeslice-verl is validated with) plus timeslice-verl with
# its batch service, so one image runs the supervised vLLM and the batch API beside it.
#   docker build -f deploy/images/tenant.Dockerfile -t REGISTRY/timeslice-verl/tenant:VERSION .
ARG BASE=docker.io/vllm/vllm-openai:v0.24.0
FROM ${BASE}
COPY . /src/timeslice-verl
RUN pip install --no-cache-dir '/src/timeslice-verl[batch]' && rm -rf /src/timeslice-verl
ENV PYTHONUNBUFFERED=1
# `tenant run [--gpu auto] -- vllm serve …`: starts vLLM tagged TIMESLICE_TENANT with sleep mode and dev endpoints,
# waits for the GPU memory it asks for, restarts it when it dies, registers it with the node's agent.
ENTRYPOINT ["timeslice-verl", "tenant", "run"]
