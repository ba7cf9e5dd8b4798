"""The trainer side of a GPU handoff: the sequence written once (``sequence``: release, skip, prepare, acquire,
crash, done), its settings (``options``), its figures (``figures``), the valley forecast (``forecast``, pure), the
way back ahead of need (``wayback``), the swap choice (``swap_choice``, pure), reaching the node's agent
(``connect``), every node's agent for a job across nodes (``nodes``) and SPMD trainers' ranks (``spmd``)."""
