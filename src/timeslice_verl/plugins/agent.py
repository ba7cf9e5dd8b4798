"""The agent plugin: turns lifecycle events into GPU handoffs through the node's snapshot agent.

=========================  ==================================================================
event                      handoff (:class:`timeslice_verl.handoff.Handoff`)
=========================  ==================================================================
init_workers_begin         acquire (model loading needs the GPU)
init_workers_end           pin park buffers, register worker pids, release
pre_train_step             acquire — blocks until the trainer's processes are restored
weight_sync_begin          make sure the GPU is held (a real acquire only before the pre-fit sync)
weight_sync_end            release, when weights were synced, no model save follows in this step and
                           the valley pays (else skip: the next batch is queued, or it is too short);
                           the way back starts ahead of the valley's forecast end
save_checkpoint_begin      make sure the GPU is held, and allow the save
save_checkpoint_end        release (after the step's save: the release deferred at weight_sync_end)
trainer_exception          crash: unpark, then release (never leave the GPU pinned to a dead job)
timeslice_stop             done: unpark, release, close the connection
=========================  ==================================================================

An acquire that fails raises (gating hooks stop the trainer: it never trains without its GPU); a
release that fails is logged and swallowed (the agent also releases when the connection drops).
Each handoff is reported through the ``handoff`` hook for the timeline and metrics plugins.
"""

from __future__ import annotations

from typing import Any

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.handoff.connect import connect
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.sequence import Handoff, handoff_event
from timeslice_verl.hooks.events import Event
from timeslice_verl.hooks.spec import hookimpl
from timeslice_verl.log import get_logger

log = get_logger("handoff")


class AgentPlugin:
    name = "agent"

    def __init__(self) -> None:
        self.handoff: Handoff | None = None
        self.lifecycle: Any = None
        self.job = ""
        self.held_for_save = False
        self.release_after_save = False

    @property
    def client(self) -> AgentClient | None:
        # never raises: pluggy reads every attribute of a plugin when it registers it
        return self.handoff.client if self.handoff is not None else None

    # ------------------------------------------------------------------ set-up

    @hookimpl
    def timeslice_start(self, trainer: Any, event: Event, lifecycle: Any) -> None:
        settings = lifecycle.settings
        self.lifecycle, self.job = lifecycle, lifecycle.job
        ranks = getattr(lifecycle, "ranks", None)
        HandoffOptions.from_settings(settings).check(can_park=ranks is not None)  # refused before any connection
        if settings.agent.across_nodes:  # verl's workers span nodes: every node's agent takes part
            from timeslice_verl.handoff.nodes import NodeAgents

            client: Any = NodeAgents.on_ray_nodes(client_name=f"trainer:{self.job}",
                                                  connect_timeout_s=settings.agent.connect_timeout_s)
        else:
            client = connect(settings, client_name=f"trainer:{self.job}")
        self.handoff = Handoff.from_settings(
            settings, client=client, ranks=ranks, backlog=getattr(lifecycle, "backlog", None),
            report=lambda figures: lifecycle.handoff(handoff_event(lifecycle, figures)),
        )
        self.handoff.held = self.handoff.granted = False  # the first acquire (before verl loads the model) goes to the agent
        self._ensure_tenant(settings)

    def _ensure_tenant(self, settings: Any) -> None:
        urls = settings.tenant.urls
        if not urls or self.client is None or settings.agent.across_nodes:  # across nodes: each agent has its own
            return
        if self.client.status().get("tenant") is None:
            try:
                self.client.register_tenant(urls, sleep_level=settings.tenant.sleep_level)
            except AgentError as exc:
                log.error("[timeslice] job=%s could not register tenant %s: %s (training goes on)", self.job, urls, exc)

    # ------------------------------------------------------------------ handoffs (used by tests and tools)

    def acquire(self, point: str) -> None:
        assert self.handoff is not None
        self.handoff.acquire(point)

    def release(self, point: str) -> None:
        assert self.handoff is not None
        self.held_for_save = self.release_after_save = False
        self.handoff.release(point)

    @property
    def held(self) -> bool:
        return self.handoff is not None and self.handoff.held

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def init_workers_begin(self) -> None:
        self.acquire("init_workers_begin")

    @hookimpl
    def init_workers_end(self) -> None:
        assert self.handoff is not None
        self.handoff.begin()
        self.release("init_workers_end")

    @hookimpl
    def pre_train_step(self) -> None:
        self.acquire("pre_train_step")

    @hookimpl
    def weight_sync_begin(self) -> None:
        self.acquire("weight_sync_begin")  # no-op when already held

    @hookimpl
    def weight_sync_end(self, event: Any) -> None:
        if not event.synced:
            return
        if getattr(event, "save_follows", False):
            self.release_after_save = True  # the step's save still needs the GPU: release after it
            return
        self.release("weight_sync_end")

    @hookimpl
    def save_checkpoint_begin(self) -> bool:
        if not self.held:
            self.acquire("save_checkpoint_begin")
            self.held_for_save = True
        return True  # the save always runs: the trainer holds the GPU for it

    @hookimpl
    def save_checkpoint_end(self) -> None:
        if self.held_for_save or self.release_after_save:
            self.release("save_checkpoint_end")

    @hookimpl
    def trainer_exception(self, event: Any) -> None:
        if self.handoff is not None:
            self.handoff.crash(f"exception:{event.point}")

    @hookimpl(tryfirst=True)  # its last release reaches the observers before they close
    def timeslice_stop(self) -> None:
        if self.handoff is not None:
            # done: the workers are exiting, so the agent forgets the job rather than freezing them; it
            # also withdraws a prepare sent for a step that never comes
            self.handoff.done("timeslice_stop")
            self.handoff.close()


__all__ = ["AgentPlugin"]
