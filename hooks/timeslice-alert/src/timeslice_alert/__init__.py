# src/timeslice_alert/__init__.py
"""Tell when a job waited long for its GPU, or crashed."""

from timeslice_verl import hookimpl


class AlertPlugin:
    """Options (``timeslice.plugins.options.alert``): ``threshold_s``, the wait worth telling (default 30)."""

    def __init__(self) -> None:
        self.threshold_s = 30.0

    @hookimpl
    def timeslice_start(self, lifecycle):
        options = lifecycle.settings.plugins.options.get("alert", {}) or {}
        self.threshold_s = float(options.get("threshold_s", 30))

    @hookimpl
    def handoff(self, event):
        if event.action == "acquire" and event.waited_s > self.threshold_s:
            print(f"job {event.job} waited {event.waited_s:.0f} s for its GPU at step {event.step}")

    @hookimpl
    def trainer_exception(self, event):
        print(f"job {event.job} crashed at {event.point}: {event.error_type}: {event.message}")
