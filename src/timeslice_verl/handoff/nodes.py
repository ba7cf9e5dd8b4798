"""verl across nodes: every node's agent takes part in each handoff.

verl's driver reaches only its own node's agent socket, so for a job whose workers span nodes the handoff's
agent client is :class:`NodeAgents`: one small Ray actor per node (scheduled there with Ray's node affinity,
no CPU reserved, never a GPU process) holds that node's :class:`~timeslice_verl.agent.client.AgentClient` on
the node's default socket, and every request goes to all of them at once. A release completes when every
node's agent took its share (each node's park reports go to its own agent); an acquire completes only when
every node's agent granted; a node whose agent or actor fails makes the others release with ``done`` (their
GPUs go back to their tenants, their workers are thawed) and the handoff raises
:class:`~timeslice_verl.handoff.RankLost`.
"""

from __future__ import annotations

from typing import Any

from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("handoff.nodes")

CALL_TIMEOUT_S = 900.0
"""The longest a node's agent call may take before the node is taken for lost (an acquire waits its deadline)."""


class NodeAgent:
    """Runs on one node (a Ray actor): that node's agent client."""

    def __init__(self, socket: str, client_name: str, connect_timeout_s: float) -> None:
        from timeslice_verl.agent.client import AgentClient
        from timeslice_verl.config.schema import default_socket

        path = socket or str(default_socket())  # this node's default path
        self.client = AgentClient(path, connect_timeout_s=connect_timeout_s, client=client_name)

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client, op)(*args, **kwargs)


class NodeAgents:
    """The agent client of a job whose GPUs span nodes (same calls as ``AgentClient``), keyed by Ray node id."""

    def __init__(self, actors: dict[str, Any]) -> None:
        self.actors = actors

    @classmethod
    def on_nodes(cls, node_ids: list[str], *, socket: str = "", client_name: str = "timeslice-verl",
                 connect_timeout_s: float = 30.0) -> NodeAgents:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # threads: a crash's release must reach the node while the way back's acquire still waits there
        actor_cls = ray.remote(num_cpus=0, max_concurrency=8)(NodeAgent)
        actors = {
            node: actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                socket, client_name, connect_timeout_s)
            for node in dict.fromkeys(node_ids)
        }
        return cls(actors)

    @classmethod
    def on_ray_nodes(cls, *, client_name: str, connect_timeout_s: float) -> NodeAgents:
        """Every live node of the Ray cluster whose agent answers (model loading: before any worker exists)."""
        import ray

        nodes = cls.on_nodes([n["NodeID"] for n in ray.nodes() if n.get("Alive")], client_name=client_name,
                             connect_timeout_s=connect_timeout_s)
        _, errors = nodes._each("hello")
        for node, exc in errors.items():
            log.warning("node %s has no agent that answers (%s): its GPUs take no part in the handoffs", node[:8], exc)
            ray.kill(nodes.actors.pop(node))
        return nodes

    def keep(self, node_ids: list[str], job: str) -> None:
        """Only these nodes from now on (the ones that host the job's workers); the others give the GPUs back."""
        import ray

        for node in [n for n in self.actors if n not in node_ids]:
            try:
                self._one(node, "release", job, done=True)
            except Exception as exc:
                log.warning("node %s: final release failed: %s", node[:8], exc)
            ray.kill(self.actors.pop(node))
        missing = [n[:8] for n in node_ids if n not in self.actors]
        if missing:
            log.warning("node(s) %s host workers of job %s but no agent answered there at start: their GPUs are "
                        "not lent", ", ".join(missing), job)

    def _each(self, op: str, per_node: dict[str, tuple[tuple, dict]] | None = None, *args: Any,
              **kwargs: Any) -> tuple[dict[str, Any], dict[str, BaseException]]:
        import ray

        refs = {node: actor.call.remote(op, *(per_node[node][0] if per_node else args),
                                        **(per_node[node][1] if per_node else kwargs))
                for node, actor in self.actors.items()}
        replies, errors = {}, {}
        for node, ref in refs.items():
            try:
                replies[node] = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # the node's agent refused, or the node (its actor) is gone
                errors[node] = exc
        return replies, errors

    def _lost(self, op: str, job: str, errors: dict[str, BaseException], granted: list[str]) -> None:
        """A node failed: every node that holds the job's GPUs gives them back, then the handoff fails."""
        from timeslice_verl.handoff.ranks import RankLost

        for node in granted:
            try:
                self._one(node, "release", job, done=True)
            except Exception as exc:
                log.error("node %s could not give its GPUs back after node(s) %s failed: %s", node[:8], list(errors), exc)
        detail = "; ".join(f"node {n[:8]}: {type(e).__name__}: {e}" for n, e in errors.items())
        raise RankLost(f"{op} of job {job!r} failed on {len(errors)} of {len(self.actors)} node(s) ({detail}); "
                       f"the other nodes gave their GPUs back")

    def _one(self, node: str, op: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(self.actors[node].call.remote(op, *args, **kwargs), timeout=CALL_TIMEOUT_S)

    # ------------------------------------------------------------------ AgentClient's calls

    def acquire(self, job: str, *, timeout_s: float | None = None, pids: list[int] | None = None) -> dict[str, Any]:
        replies, errors = self._each("acquire", None, job, timeout_s=timeout_s)
        if errors:
            self._lost("acquire", job, errors, list(replies))
        return _merge(replies)

    def release(self, job: str, *, wait: bool = False, done: bool = False, swap: SwapMode = SwapMode.checkpoint,
                parked: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        per_node = {node: ((job,), {"wait": wait, "done": done, "swap": swap,
                                    "parked": [{k: v for k, v in r.items() if k != "node"}
                                               for r in parked or [] if r.get("node") == node] or None})
                    for node in self.actors}
        replies, errors = self._each("release", per_node)
        if errors:
            self._lost("release", job, errors, list(replies))
        return _merge(replies)

    def prepare(self, job: str, ttl_s: float | None = None) -> dict[str, Any]:
        replies, _ = self._each("prepare", None, job, ttl_s=ttl_s)  # a hint: a node that misses it acquires later
        return {"job": job, "accepted": all(r.get("accepted") for r in replies.values())}

    def register_ranks(self, job: str, ranks: Any) -> None:
        """Once the workers exist: keep only the nodes that host them, and tell each its workers' pids."""
        pids = ranks.node_pids()
        self.keep(list(pids), job)
        self.register_node_pids(job, pids)

    def register_node_pids(self, job: str, pids: dict[str, list[int]]) -> None:
        """Each node's agent learns the job's worker pids on that node."""
        per_node = {node: ((job, pids.get(node, [])), {}) for node in self.actors}
        _, errors = self._each("register_pids", per_node)
        for node, exc in errors.items():
            log.warning("node %s: could not register worker pids %s: %s", node[:8], pids.get(node), exc)

    def register_pids(self, job: str, pids: list[int]) -> dict[str, Any]:
        raise TypeError("register_pids needs to know each pid's node: use register_node_pids")

    def status(self) -> dict[str, Any]:
        replies, errors = self._each("status")
        return {"nodes": replies, "unreachable": {n: str(e) for n, e in errors.items()}}

    def close(self) -> None:
        import ray

        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:  # already gone with its node
                pass
        self.actors = {}


def _merge(replies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One reply for the handoff: the slowest node's times, every node's transitions, byte totals."""
    values = list(replies.values())
    return {
        "nodes": replies,
        "transitions": [t for r in values for t in r.get("transitions", [])],
        "thawed": any(r.get("thawed") for r in values),
        "thaw_s": max((float(r.get("thaw_s", 0.0)) for r in values), default=0.0),
        "waited_s": max((float(r.get("waited_s", 0.0)) for r in values), default=0.0),
        "frozen_bytes": sum(int(r.get("frozen_bytes", 0)) for r in values),
        "released": any(r.get("released") for r in values),
    }


__all__ = ["NodeAgent", "NodeAgents"]
