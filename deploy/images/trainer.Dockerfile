# The trainer's image: a versioned vLLM release image (verl's own images since 0.6 build on these), verl pinned
# to the release timeslice-verl is tested with, and timeslice-verl with its verl extra (its verl.plugins entry
# point is found by `import verl` in every Ray process). Change BASE and VERL together, to versions you run.
#   docker build -f deploy/images/trainer.Dockerfile -t REGISTRY/timeslice-verl/trainer:VERSION .
ARG BASE=docker.io/vllm/vllm-openai:v0.24.0
FROM ${BASE}
ARG VERL=0.9.1
COPY . /src/timeslice-verl
RUN pip install --no-cache-dir "verl==${VERL}" '/src/timeslice-verl[verl]' && rm -rf /src/timeslice-verl
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
