"""verl adapters: fire the lifecycle events from a running verl fully-async trainer.

* :mod:`.stock` wraps the seams of ``FullyAsyncTrainer`` from PyPI verl (0.9.x), which has no hooks;
* :mod:`.v1` subclasses verl's v1 ``PPOTrainerSeparateAsync`` and fires the events from its ``on_*`` hooks;
* :mod:`.hooked` registers a trainer named ``timeslice`` in verl builds that have fully-async
  lifecycle hooks and a trainer registry, and maps its ``on_*`` methods onto the hookspec;
* :mod:`.verl_entry` is what verl's own ``verl.plugins`` entry point loads on ``import verl`` in
  every verl process: it installs them, lazily, when verl's trainer modules are imported.

All are inert unless the trainer's config has an enabled ``timeslice`` section; ``timeslice.adapter``
(``auto|stock|v1|hooked``) picks which one fires, so events never fire twice. Nothing imports this package
except verl's entry point and the tests.
"""

TRAINER_MODULE = "verl.experimental.fully_async_policy.fully_async_trainer"
"""The module of PyPI verl's fully-async trainer class (the stock adapter's target)."""
V1_MODULE = "verl.trainer.ppo.v1.trainer_separate_async"
"""The module of verl's v1 ``separate_async`` trainer (the v1 adapter's base class)."""
