"""A faithful stand-in for the verl fork that has fully-async lifecycle hooks, built on the real class.

The fork (``feat/fully-async-lifecycle-hooks``) adds to ``FullyAsyncTrainer`` empty template
methods and calls them at its phase transitions, plus a registry that ``fully_async_main`` reads
``async_training.trainer_name`` from. This module reproduces exactly that on top of PyPI verl's
``FullyAsyncTrainer`` — same seams, same order — so the fork adapter can be tested without the
fork: ``on_init_workers_begin/_end`` around ``init_workers``, ``on_sample_end`` when
``_fit_generate`` has its batch, ``on_update_weights_begin/_end(synced)`` around
``_fit_update_weights``, ``on_save_checkpoint(force) -> bool`` right before a due save (``False``
skips it), ``on_exception(point, exc)`` from ``fit``'s handler, once per exception.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.fully_async_policy import fully_async_trainer as _verl

TRAINER_REGISTRY: dict[str, type] = {}


def register_trainer(name: str):
    def decorate(cls: type) -> type:
        TRAINER_REGISTRY[name] = cls
        return cls

    return decorate


def get_trainer_class(name: str | None) -> type:
    return TRAINER_REGISTRY.get(name or "", FullyAsyncTrainer)


class FullyAsyncTrainer(_verl.FullyAsyncTrainer.__ray_actor_class__):  # type: ignore[misc, name-defined]
    """PyPI verl's trainer plus the fork's lifecycle template methods and their call sites."""

    # ---- template methods (empty in the fork) ----
    async def on_init_workers_begin(self) -> None: ...

    async def on_init_workers_end(self) -> None: ...

    async def on_sample_end(self) -> None: ...

    async def on_update_weights_begin(self) -> None: ...

    async def on_update_weights_end(self, synced: bool) -> None: ...

    def on_save_checkpoint(self, force: bool) -> bool:
        return True

    async def on_exception(self, point: str, exc: BaseException) -> None: ...

    # ---- call sites ----
    async def _dispatch_on_exception(self, point: str, exc: BaseException) -> None:
        if getattr(exc, "_fork_on_exception_fired", False):
            return
        try:
            exc._fork_on_exception_fired = True  # type: ignore[attr-defined]
        except Exception:
            pass
        try:
            await self.on_exception(point, exc)
        except Exception as hook_error:  # the fork logs and suppresses hook errors
            print(f"[FullyAsyncTrainer] on_exception hook failed: {hook_error!r}")

    async def init_workers(self) -> None:
        await self.on_init_workers_begin()
        await super().init_workers()
        await self.on_init_workers_end()

    async def _fit_generate(self, batch: Any = None) -> Any:
        batch = await super()._fit_generate(batch)
        await self.on_sample_end()
        return batch

    async def _fit_update_weights(self) -> dict | None:
        await self.on_update_weights_begin()
        result = await super()._fit_update_weights()
        await self.on_update_weights_end(synced=result is not None)
        return result

    def _fit_save_checkpoint(self, force: bool = False) -> None:
        self._fork_save_force = force
        return super()._fit_save_checkpoint(force)

    def _save_checkpoint(self) -> None:
        if not self.on_save_checkpoint(getattr(self, "_fork_save_force", False)):
            return None
        return super()._save_checkpoint()

    async def fit(self) -> None:
        try:
            return await super().fit()
        except Exception as exc:
            await self._dispatch_on_exception("fit", exc)
            raise
