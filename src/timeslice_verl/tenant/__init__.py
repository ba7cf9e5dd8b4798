"""The node's tenant as a process: ``timeslice-verl tenant run`` starts vLLM the way the agent needs it and brings it
back when it dies (``supervisor``), on a GPU with room for it (``memory``)."""
