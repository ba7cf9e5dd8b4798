"""verl adapters: fire the lifecycle events from a running verl fully-async trainer.

* :mod:`.stock` wraps the seams of ``FullyAsyncTrainer`` from PyPI verl (0.9.x), which has no hooks;
* :mod:`.fork` registers a trainer named ``timeslice`` in verl builds that have fully-async
  lifecycle hooks and a trainer registry, and maps its ``on_*`` methods onto the hookspec;
* :mod:`.verl_entry` is what verl's own ``verl.plugins`` entry point loads on ``import verl`` in
  every verl process: it installs both, lazily, when verl's trainer module is imported.

Both are inert unless the trainer's config has an enabled ``timeslice`` section; ``timeslice.adapter``
(``auto|fork|stock``) picks which one fires, so events never fire twice. Nothing imports this package
except verl's entry point and the tests.
"""
