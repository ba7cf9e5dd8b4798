"""The tenant's supervisor (not the agent's view of the tenant, which is :mod:`timeslice_verl.agent.tenant`):
``timeslice-verl tenant run`` starts vLLM the way the agent needs it and brings it back when it dies
(``supervisor``), its processes one unit (``process``), on a GPU with room for it (``memory``)."""
