"""What runs inside a trainer's GPU rank: parking its tensors in pinned host RAM (``park``) and the methods verl's
workers (and the demo's, and SPMD ranks) call for a handoff (``worker``). torch is imported lazily."""
