"""Trainer → rollout weights on ONE GPU over CUDA IPC: verl checkpoint engine ``timeslice_ipc``.

verl's built-in engines cannot serve a trainer and a rollout on one GPU (NCCL refuses two ranks on one device, and
``naive`` is the colocated hybrid). This one lets the trainer copy its weights into two GPU buckets that the
rollout process opens in place through CUDA IPC handles, on the same physical GPU (checked by UUID).

``+timeslice=one_gpu`` sets, in verl's config (the exact override set; :data:`~.one_gpu.ONE_GPU_KEYS`)::

    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.checkpoint_engine.backend=timeslice_ipc
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=timeslice_verl.weights_ipc.engine
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512
    trainer.nnodes=1 trainer.n_gpus_per_node=1 rollout.nnodes=1 rollout.n_gpus_per_node=1
    +ray_kwargs.ray_init.num_gpus=2

and no ``timeslice`` section, so alone it leaves time-slicing off and it combines with another option as a list:
``+timeslice=[one_gpu,interleave]`` (or ``[one_gpu,observe]``). The launcher's preflight (before Ray starts) sets ``CUDA_VISIBLE_DEVICES=N,N`` (GPU N twice: unset → ``0,0``,
``N`` → ``N,N``; Ray refuses ``num_gpus=2`` with one entry, and with none the rollout gets a device that does not
exist) and ``ray_kwargs.ray_init.num_cpus`` (when null: this process's CPUs). It refuses, naming the key, a config
that changed one of the keys above while keeping the engine. vLLM's share of the GPU
(``actor_rollout_ref.rollout.gpu_memory_utilization``) is the user's to leave room for the trainer.

Layers: :mod:`.layout`, :mod:`.devices`, :mod:`.channel`, :mod:`.one_gpu` need neither torch nor verl;
:mod:`.transport` imports torch lazily; only :mod:`.engine` imports verl (importing it registers the engine).
"""

BACKEND = "timeslice_ipc"
"""The engine's name in verl's ``CheckpointEngineRegistry`` (``checkpoint_engine.backend``)."""
ENGINE_MODULE = "timeslice_verl.weights_ipc.engine"
"""What ``checkpoint_engine.custom_backend_module`` names: verl imports it, which registers the engine."""

METRIC_BYTES = f"{BACKEND}/bytes"
METRIC_SECONDS = f"{BACKEND}/seconds"
METRIC_BUCKETS = f"{BACKEND}/buckets"
"""The engine's per-sync metrics, as ``send_weights`` returns them to verl's manager (bytes pushed; seconds from the
first tensor to the receivers' last acknowledgement; buckets sent)."""

__all__ = ["BACKEND", "ENGINE_MODULE", "METRIC_BUCKETS", "METRIC_BYTES", "METRIC_SECONDS"]
