"""The batch service: an OpenAI-compatible batch queue in front of the node's tenant that outlives it.

``store`` (every line's fate, over ``engine``: SQLite for one node, PostgreSQL — ``pg`` — for a cluster's one
queue; ``claims``: lines under leases), ``lines`` (the JSONL files in and out), ``feeder`` (sends lines while the
tenant has the GPU, retries what the handoffs failed), ``app`` (the HTTP API), ``service`` (``timeslice-verl batch
serve``), ``client`` (``timeslice-verl batch submit|status|results|cancel``). Needs the ``batch`` extra (FastAPI,
uvicorn) to serve; the client needs only the core.
"""
