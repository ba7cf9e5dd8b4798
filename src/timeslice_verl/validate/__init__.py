"""Validation off the trainer's critical path: the policy tenant (a vLLM that holds one version of the actor's
weights, pushed through vLLM's weight-transfer API), the schedule of due versions, and the run of each as a batch
of the batch service, scored and logged at its version's step."""
