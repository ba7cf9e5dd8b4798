"""The agent's tenant: the vLLM server(s) it lends the GPU to — the HTTP contract (``vllm.py``), a group of servers
(``group.py``), which process a server is (``proc.py``), the reclaim ladder (``ladder.py``), what the agent does and
sees of it (``tenancy.py``, ``probe.py``, ``warmup.py``) and whether a yield may be a pause alone (``hold.py``,
``peaks.py``)."""
