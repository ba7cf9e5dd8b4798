# The trainer's image: verl's own image plus timeslice-verl (its verl.plugins entry point is found by
# `import verl` in every Ray process). Pin BASE to the verl image you run today.
#   docker build -f deploy/images/trainer.Dockerfile --build-arg BASE=verlai/verl:TAG -t REGISTRY/timeslice-verl-trainer:0.1.0 .
ARG BASE=verlai/verl:latest
FROM ${BASE}
COPY . /src/timeslice-verl
RUN pip install --no-cache-dir /src/timeslice-verl && rm -rf /src/timeslice-verl
