"""A handoff's settings, built one way for every trainer kind: :meth:`HandoffOptions.from_settings`.

The agent plugin (verl's driver) and :class:`~timeslice_verl.handoff.spmd.RankHandoff` (SPMD ranks) both build
their :class:`~timeslice_verl.handoff.sequence.Handoff` from the ``timeslice.handoff`` section through here, so
no setting is dropped for one of them; :meth:`HandoffOptions.check` is the one check of the swap mode.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from timeslice_verl.handoff.forecast import LATE_COST, MARGIN
from timeslice_verl.names import SwapMode, swap_setting


class SwapUnavailable(ValueError):
    """The swap mode the settings ask for cannot run on this trainer (named by its key)."""


@dataclass(frozen=True)
class HandoffOptions:
    """How one trainer hands its GPUs over (``timeslice.handoff``): see :class:`~timeslice_verl.config.schema.HandoffSettings`."""

    swap: SwapMode | None = None
    """None: ``auto``, the mode picked when the handoff starts (a string is taken as its setting)."""
    acquire_timeout_s: float | None = None
    """None: an acquire waits as long as it takes."""
    prepare: bool = True
    prepare_lead_s: float = 0.0
    break_even_margin: float = MARGIN
    late_cost: float = LATE_COST

    @classmethod
    def from_settings(cls, settings: Any, **override: Any) -> HandoffOptions:
        """The options of a ``timeslice`` section (every key of ``handoff``); ``override``: keyword arguments a
        caller gives on top (an SPMD trainer's ``RankHandoff(swap=...)``)."""
        section = settings.handoff
        values = {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        values["swap"] = values.get("swap")
        values.update({k: v for k, v in override.items() if v is not None})
        values["acquire_timeout_s"] = values.get("acquire_timeout_s") or None
        return cls(**values)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "swap", swap_setting(self.swap))
        except ValueError as exc:
            raise SwapUnavailable(f"timeslice.handoff.swap: {exc}") from None

    def check(self, *, can_park: bool) -> HandoffOptions:
        """The options for a trainer whose ranks can (or cannot) move their own tensors: ``auto`` becomes
        ``checkpoint`` where nothing could park; a mode that needs ranks is refused, naming the key."""
        if can_park or self.swap is SwapMode.checkpoint:
            return self
        if self.swap is None:
            return HandoffOptions(**{**self.__dict__, "swap": SwapMode.checkpoint})
        raise SwapUnavailable(f"timeslice.handoff.swap={self.swap} needs trainer ranks that move their own tensors "
                              "(verl's worker groups, or a RankHandoff in an SPMD trainer); this trainer has none: use "
                              "timeslice.handoff.swap=checkpoint")


__all__ = ["HandoffOptions", "SwapUnavailable"]
