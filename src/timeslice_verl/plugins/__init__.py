"""Bundled hook plugins, registered by default when ``timeslice`` is enabled.

``agent`` moves the GPU through the node's snapshot agent, ``timeline`` records every event to
JSONL, ``metrics`` puts handoff figures into the trainer's metrics. Each can be switched off with
``timeslice.plugins.disabled=[name]``.
"""
