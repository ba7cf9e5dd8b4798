"""The snapshot agent: one small daemon per node that moves the GPU between trainer jobs and vLLM.

``server`` (asyncio, Unix socket) ⇄ ``client`` (used by the bundled agent plugin and the CLI);
``arbiter`` decides who owns the GPU and performs one transition at a time; ``state`` persists
that state machine; ``trainer`` freezes and thaws a job's GPU processes (CUDA checkpoint/restore);
``tenant`` pauses, sleeps, wakes and resumes vLLM. Nothing here imports verl or pluggy.
"""
