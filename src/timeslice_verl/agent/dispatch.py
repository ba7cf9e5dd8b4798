"""What each operation of the protocol does: a table from op to the arbiter's call (the request already validated
by :func:`~timeslice_verl.agent.client.protocol.parse_request`)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.client.protocol import OPS
from timeslice_verl.names import SwapMode

READ_ONLY = frozenset({"hello", "status", "watch_owner"})
"""Requests that change nothing the state file records (the others are answered once their state is on disk)."""
Handler = Callable[[Arbiter, dict[str, Any], int, "int | None"], Any]


def _supervisor(args: dict[str, Any]) -> dict[str, Any]:
    return {"supervisor": args["supervisor"]} if args.get("supervisor") else {}


HANDLERS: dict[str, Handler] = {
    "acquire": lambda a, args, conn, uid: a.acquire(args["job"], conn, timeout_s=args.get("timeout_s"),
                                                    pids=args.get("pids"), peer_uid=uid),
    "release": lambda a, args, conn, uid: a.release(args["job"], conn, wait=args.get("wait", False),
                                                    done=args.get("done", False), swap=args.get("swap", SwapMode.checkpoint),
                                                    parked=args.get("parked")),
    "prepare": lambda a, args, conn, uid: a.prepare(args["job"], conn, args.get("ttl_s")),
    "register_pids": lambda a, args, conn, uid: a.register_pids(args["job"], args["pids"], conn, uid),
    "attach": lambda a, args, conn, uid: a.attach(args["job"], conn, holding=args.get("holding", False), peer_uid=uid),
    "register_tenant": lambda a, args, conn, uid: a.register_tenant(args["urls"], args.get("sleep_level", 1),
                                                                    **_supervisor(args)),
    "unregister_tenant": lambda a, args, conn, uid: a.unregister_tenant(),
    "watch_owner": lambda a, args, conn, uid: a.watch_owner(args.get("seen", ""), args.get("timeout_s")),
}


class Dispatcher:
    """Runs one validated request against the arbiter; ``info`` answers ``hello`` (what the daemon is)."""

    def __init__(self, arbiter: Arbiter, info: Callable[[], dict[str, Any]]) -> None:
        self.arbiter, self.info = arbiter, info
        missing = set(OPS) - set(HANDLERS) - {"hello", "status"}
        if missing:  # pragma: no cover - a new op must say what it does
            raise TypeError(f"protocol op(s) without a handler: {sorted(missing)}")

    async def __call__(self, op: str, args: dict[str, Any], conn: int, peer_uid: int | None) -> dict[str, Any]:
        if op == "hello":
            return self.info()
        if op == "status":
            return {"agent": self.info(), **self.arbiter.snapshot()}
        result = HANDLERS[op](self.arbiter, args, conn, peer_uid)
        return await result if inspect.isawaitable(result) else result


__all__ = ["HANDLERS", "READ_ONLY", "Dispatcher"]
