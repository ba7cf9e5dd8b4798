"""The stand-in vLLM: vLLM's HTTP endpoints with generation simulated on the CPU (no GPU, no model).

A product command (``timeslice-verl tenant standin``, the demo's dry run) for trying the agent, the supervisor and
the batch service where no GPU is; the test kit (:mod:`timeslice_verl.testing`) uses it, it never uses the test kit.
:mod:`.server` answers HTTP, :mod:`.engine` holds the state and simulates generation, :mod:`.weights` takes
vLLM's weight-transfer calls.
"""
