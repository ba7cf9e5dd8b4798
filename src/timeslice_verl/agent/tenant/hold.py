"""Whether a yield may only pause the tenant (its memory stays, held requests keep their KV cache) or must put it to
sleep. Pure: the agent passes what NVML measured.

A pause costs milliseconds each way and loses nothing; a sleep frees the tenant's memory for the trainer but costs a
wake-up and the held requests' KV cache. A pause alone is safe only when the trainer, coming back, never needs the
tenant's memory: when the job's *measured peak* (the most NVML ever saw its processes use while it held the GPU —
what its caching allocator reserved, not its live tensors) fits in what is free now plus what the job uses now, with
a margin. Without a measured peak (the job's first hold) the tenant sleeps. While the tenant is held awake and the
trainer computes, the agent keeps watching: once the GPU's free memory falls under half the margin (a peak that grew,
e.g. longer responses later in training) the held tenant is put to sleep at once (:func:`tight`), and the grown peak
decides the next yields.
"""

from __future__ import annotations

from dataclasses import dataclass

from timeslice_verl.names import YieldBy

GIB = 2**30
MARGIN_FRACTION = 0.25
"""The margin is at least this share of the job's measured peak (a trainer's peak moves with its batch)."""


@dataclass(frozen=True)
class HoldPolicy:
    by: YieldBy = YieldBy.auto
    margin_bytes: int = 4 * GIB
    """The least room left beside the trainer's measured peak and the held tenant (``tenant.awake_margin_gib``)."""

    def margin(self, peak: int) -> int:
        return max(self.margin_bytes, int(MARGIN_FRACTION * peak))


@dataclass(frozen=True)
class Fit:
    pause_only: bool
    why: str


def decide(policy: HoldPolicy, *, free: int | None, job_now: int, job_peak: int) -> Fit:
    """Pause only, or sleep. ``free``: the GPU's free bytes now (None without NVML); ``job_now``/``job_peak``: the
    bytes the job's processes use now and the most they were seen to use while holding (0: not measured yet)."""
    if policy.by is YieldBy.sleep:
        return Fit(False, "timeslice.tenant.yield_by=sleep")
    if free is None:
        return Fit(False, "no NVML: the trainer's memory cannot be measured")
    if job_peak <= 0:
        return Fit(False, "the trainer's peak is not measured yet (its first hold)")
    need = max(0, job_peak - job_now)
    margin = policy.margin(job_peak)
    left = free - need
    figures = (f"trainer peak {job_peak / GIB:.2f} GiB, using {job_now / GIB:.2f} GiB, {free / GIB:.2f} GiB free, "
               f"margin {margin / GIB:.2f} GiB")
    if left >= margin:
        return Fit(True, f"fits: {figures}")
    return Fit(False, f"does not fit: {figures}")


def tight(policy: HoldPolicy, *, free: int, job_peak: int) -> bool:
    """While the tenant is held awake beside a computing trainer: True when the trainer has eaten into the margin
    (free under half of it), so the held tenant must sleep now."""
    return free < policy.margin(job_peak) // 2


__all__ = ["Fit", "HoldPolicy", "MARGIN_FRACTION", "YieldBy", "decide", "tight"]
