"""Target of verl's ``verl.plugins`` entry point, loaded by ``import verl`` in every verl process.

Importing it must stay cheap and safe: it only registers a post-import hook, so the adapters are
installed the moment (and only if) verl's fully-async trainer module is imported — in the driver,
in the trainer's Ray actor process, anywhere. Without a ``timeslice`` section in the trainer's
config the installed adapters do nothing.
"""

from __future__ import annotations

from types import ModuleType

import wrapt

from timeslice_verl.log import get_logger

log = get_logger("adapter")

TRAINER_MODULE = "verl.experimental.fully_async_policy.fully_async_trainer"  # also in adapters.binding


def install_adapters(module: ModuleType) -> None:
    """Install the stock adapter on the module's trainer class and the fork adapter if it can."""
    from timeslice_verl.adapters import fork, stock

    try:
        stock.install(module.FullyAsyncTrainer)
        fork.install(module)
    except Exception:  # never break `import verl` for users who do not time-slice
        log.exception("timeslice: could not install the verl adapters; time-slicing is off in this process")


wrapt.register_post_import_hook(install_adapters, TRAINER_MODULE)
