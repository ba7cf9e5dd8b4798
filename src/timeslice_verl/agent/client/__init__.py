"""What every other layer imports of the agent: the client (``connection.py``) and the wire protocol
(``protocol.py``). The socket between this room and the daemon is the architecture's main line: nothing here imports
the daemon."""

from timeslice_verl.agent.client.connection import (  # noqa: F401 (the client's public names)
    AgentClient,
    AgentError,
    wait_for_agent,
)

__all__ = ['AgentClient', 'AgentError', 'wait_for_agent']
