"""Target of verl's ``verl.plugins`` entry point, loaded by ``import verl`` in every verl process.

Importing it must stay cheap and safe: it only registers a post-import hook, so the adapters are
installed the moment (and only if) verl's fully-async trainer module is imported — in the driver,
in the trainer's Ray actor process, anywhere. Without a ``timeslice`` section in the trainer's
config the installed adapters do nothing.
"""

from __future__ import annotations

from types import ModuleType

import wrapt

from timeslice_verl.adapters import TRAINER_MODULE, V1_MODULE
from timeslice_verl.adapters.workers import WORKER_MODULE
from timeslice_verl.log import get_logger

log = get_logger("adapter")



def install_adapters(module: ModuleType) -> None:
    """Install the stock adapter on the module's trainer class and the hooked adapter if it can."""
    from timeslice_verl.adapters import hooked, stock

    try:
        stock.install(module.FullyAsyncTrainer)
        hooked.install(module)
    except Exception:  # never break `import verl` for users who do not time-slice
        log.exception("timeslice: could not install the verl adapters; time-slicing is off in this process")


def install_worker_methods(module: ModuleType) -> None:
    """Add our registered methods to verl's base ``Worker`` before verl builds worker classes."""
    from timeslice_verl.ranks.worker import install_worker_methods as install

    try:
        install(module)
    except Exception:  # never break `import verl`
        log.exception("timeslice: could not add the worker methods; caches are not freed before a freeze")


def install_preflight(module: ModuleType) -> None:
    """Check the whole config when ``run_ppo`` starts a run (fully-async and v1 mains call it)."""
    from timeslice_verl.adapters.preflight import wrap_run_ppo

    if getattr(module.run_ppo, "__timeslice_preflight__", False):
        return
    try:
        wrapt.wrap_function_wrapper(module, "run_ppo", wrap_run_ppo)
        module.run_ppo.__timeslice_preflight__ = True
    except Exception:  # never break `import verl`
        log.exception("timeslice: could not install the config preflight")


def install_v1_adapter(module: ModuleType) -> None:
    """Register the v1 adapter's trainer when verl's v1 ``separate_async`` trainer is imported."""
    from timeslice_verl.adapters import v1

    try:
        v1.install(module)
    except Exception:  # never break `import verl`
        log.exception("timeslice: could not install the v1 adapter; time-slicing is off for v1 runs")


wrapt.register_post_import_hook(install_adapters, TRAINER_MODULE)
wrapt.register_post_import_hook(install_v1_adapter, V1_MODULE)
wrapt.register_post_import_hook(install_preflight, "verl.trainer.main_ppo")
wrapt.register_post_import_hook(install_worker_methods, WORKER_MODULE)
