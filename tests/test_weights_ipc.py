"""The same-GPU CUDA IPC checkpoint engine without a GPU: its bucket layout, the device check, its place in verl's
real registry, the refusal across GPUs (in verl's topology step and on the real control socket) and the one-GPU
override set composed with verl's own fully-async config."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from timeslice_verl.config.checks import ConfigError
from timeslice_verl.weights_ipc import BACKEND, ENGINE_MODULE
from timeslice_verl.weights_ipc.devices import DeviceIdentity, DeviceMismatch, check_same_device, same_device
from timeslice_verl.weights_ipc.layout import LayoutError, Packer
from timeslice_verl.weights_ipc.one_gpu import ONE_GPU_KEYS, check_keys, one_gpu_visible, prepare_one_gpu

UUID_A = "GPU-6f0e2c1a-0000-1111-2222-333344445555"
UUID_B = "GPU-9a8b7c6d-0000-1111-2222-333344445555"


def dev(uuid: str, index: int = 0, visible: str = "0,0", host: str = "node-a", pid: int = 100) -> DeviceIdentity:
    return DeviceIdentity(uuid=uuid, index=index, visible=visible, host=host, pid=pid)


@pytest.mark.parametrize("sender, receiver, same", [
    (dev(UUID_A, 0), dev(UUID_A, 0, pid=101), True),
    (dev(UUID_A, 0, "3,3"), dev(UUID_A, 1, "0,1,2,3", pid=101), True),  # same GPU seen at different indices
    (dev(UUID_A, 0), dev(UUID_A.removeprefix("GPU-").upper(), 0, pid=101), True),  # torch's spelling vs NVML's
    (dev(UUID_A, 0), dev(UUID_B, 0, pid=101), False),  # both "cuda:0", different GPUs: indices prove nothing
    (dev(UUID_A, 0), dev(UUID_A, 0, host="node-b", pid=101), False),
    (dev("", 0), dev("", 0, pid=101), False),  # unknown UUIDs never count as the same GPU
    (dev("MIG-1234", 0), dev("mig-1234", 0, pid=101), True),
    (dev("MIG-1234", 0), dev("GPU-1234", 0, pid=101), False),
])
def test_the_device_check_compares_uuids_and_hosts_not_indices(sender, receiver, same):
    assert same_device(sender, receiver) is same
    if same:
        check_same_device(sender, receiver)
        return
    with pytest.raises(DeviceMismatch) as refused:
        check_same_device(sender, receiver)
    message = str(refused.value)
    for side in (sender, receiver):
        assert side.describe() in message
        assert f"cuda:{side.index}" in message and f"pid {side.pid}" in message


@pytest.mark.parametrize("capacity, tensors, expected", [
    # fits: aligned offsets in one bucket
    (1024, [("a", 10), ("b", 20)], [("a", 0, 0, 10, False), ("b", 256, 0, 20, False)]),
    # fits a bucket but not what is left: starts the next one, whole
    (1024, [("a", 800), ("b", 300)], [("a", 0, 0, 800, False), ("b", 0, 0, 300, True)]),
    # larger than a bucket: fills what is left, then whole buckets, in chunks
    (1024, [("a", 100), ("big", 2500)],
     [("a", 0, 0, 100, False), ("big", 256, 0, 768, False), ("big", 0, 768, 1024, True),
      ("big", 0, 1792, 708, True)]),
    # exactly full, then a chunked tensor starts the next bucket
    (1024, [("a", 1024), ("big", 1500)], [("a", 0, 0, 1024, False), ("big", 0, 0, 1024, True),
                                          ("big", 0, 1024, 476, True)]),
    # empty tensors take no room
    (1024, [("e", 0), ("a", 4)], [("e", 0, 0, 0, False), ("a", 0, 0, 4, False)]),
])
def test_the_packer_lays_tensors_out_whole_or_in_chunks(capacity, tensors, expected):
    packer = Packer(capacity)
    got = []
    for name, nbytes in tensors:
        for placement in packer.place(name, "uint8", (nbytes,), nbytes):
            p = placement.piece
            got.append((p.name, p.offset, p.chunk_offset, p.chunk_size, placement.flush_before))
            assert p.offset + p.chunk_size <= capacity and p.offset % 256 == 0
    assert got == expected


@pytest.mark.parametrize("capacity", [0, -256, 1000, "512"])
def test_a_bucket_size_that_cannot_be_laid_out_is_refused_by_value(capacity):
    with pytest.raises(LayoutError, match=repr(capacity) if not isinstance(capacity, int) or capacity <= 0
                       else str(capacity)):
        Packer(capacity)


def test_the_core_imports_neither_torch_nor_verl():
    code = ("import sys; import timeslice_verl.weights_ipc.transport, timeslice_verl.weights_ipc.one_gpu, "
            "timeslice_verl.weights_ipc.pushcheck; print(sorted(m for m in ('torch', 'verl') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.verl
def test_importing_the_module_registers_the_engine_in_verls_real_registry():
    code = textwrap.dedent(f"""
        from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
        assert {BACKEND!r} not in CheckpointEngineRegistry._registry
        import_external_libs({ENGINE_MODULE!r})  # what verl does with custom_backend_module
        cls = CheckpointEngineRegistry.get({BACKEND!r})
        engine = CheckpointEngineRegistry.new({BACKEND!r}, is_master=True, bucket_size=512 << 20)
        assert issubclass(cls, CheckpointEngine) and isinstance(engine, cls)
        assert engine.bucket_size == 512 << 20 and engine.is_master
        rollout_side = CheckpointEngineRegistry.new({BACKEND!r}, bucket_size=1 << 20)  # no is_master there
        print(cls.__module__, cls.__name__, rollout_side.is_master)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == [ENGINE_MODULE, "TimesliceIPCCheckpointEngine", "False"]


@pytest.mark.verl
def test_verls_topology_step_refuses_a_rollout_on_another_gpu_naming_both():
    from timeslice_verl.weights_ipc.channel import Address
    from timeslice_verl.weights_ipc.engine import PeerInfo, Role, TimesliceIPCCheckpointEngine

    master = PeerInfo(dev(UUID_A, 0, "0,0", pid=1), Address("/tmp/x/ctl.sock"))
    same = PeerInfo(dev(UUID_A, 0, "0,0", pid=2))
    other = PeerInfo(dev(UUID_B, 0, "1", pid=3))
    actor, rollout = TimesliceIPCCheckpointEngine.build_topology(2, 1, [master, PeerInfo(dev(UUID_B, 1)), same])
    assert actor["role"] == [Role.SENDER, Role.BYSTANDER] and rollout["role"] == [Role.RECEIVER]
    assert rollout["address"] == [master.address] and actor["receivers"] == [1, 1]
    with pytest.raises(DeviceMismatch) as refused:
        TimesliceIPCCheckpointEngine.build_topology(1, 2, [master, same, other])
    assert master.device.describe() in str(refused.value) and other.device.describe() in str(refused.value)


RECEIVER_ON_ANOTHER_GPU = """
import sys
from timeslice_verl.weights_ipc.channel import Address
from timeslice_verl.weights_ipc.devices import DeviceIdentity, DeviceMismatch
from timeslice_verl.weights_ipc.transport import Receiver
mine = DeviceIdentity(uuid={uuid!r}, index=0, visible="1", host={host!r}, pid=4242)
try:
    Receiver(Address(sys.argv[1]), timeout_s=60, device=mine).connect()
except DeviceMismatch as exc:
    print("REFUSED", exc)
"""


def test_the_sender_refuses_a_receiver_on_another_gpu_over_the_real_socket():
    import socket

    from timeslice_verl.weights_ipc.transport import Sender

    host = socket.gethostname()
    sender = Sender(1 << 20, timeout_s=60, device=dev(UUID_A, 0, "0", host=host, pid=1))
    address = sender.listen()
    peer = subprocess.Popen([sys.executable, "-c", RECEIVER_ON_ANOTHER_GPU.format(uuid=UUID_B, host=host),
                             address.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(DeviceMismatch) as refused:
            sender.accept(1)
    finally:
        out, err = peer.communicate(timeout=120)
        assert sender.close() is True  # nothing was handed out, nothing to wait for
    for message in (str(refused.value), out):
        assert UUID_A in message and UUID_B in message and "pid 4242" in message and "pid 1" in message, (out, err)
    assert out.startswith("REFUSED"), err


def test_the_control_socket_lives_in_a_private_directory_removed_at_close():
    import os
    import stat
    from pathlib import Path

    from timeslice_verl.weights_ipc.channel import Listener

    listener = Listener()
    folder = Path(listener.address.path).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    listener.close()
    assert not folder.exists()


@pytest.mark.parametrize("given, want", [(None, "0,0"), ("", "0,0"), ("3", "3,3"), ("3,3", "3,3"),
                                         ("GPU-abc", "GPU-abc,GPU-abc")])
def test_ray_sees_the_one_gpu_twice(given, want):
    assert one_gpu_visible(given) == want


@pytest.mark.parametrize("given", ["0,1", "0,0,0", "2,3,2"])
def test_a_mask_of_several_gpus_is_refused_by_name(given):
    with pytest.raises(ConfigError, match=r"^CUDA_VISIBLE_DEVICES: is '" + given + "'.*list it twice"):
        one_gpu_visible(given)


def compose_verl(overrides: list[str]):
    from verl_harness import compose

    return compose(overrides)


@pytest.mark.verl
def test_the_option_composes_with_verls_fully_async_config_and_prepares_ray():
    cfg = compose_verl(["+timeslice=one_gpu"])
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert (ce.backend, ce.custom_backend_module) == (BACKEND, ENGINE_MODULE)
    check_keys(cfg)
    assert "timeslice" not in cfg  # only verl's keys: time-slicing itself stays off
    assert cfg.async_training.require_batches == 1  # verl's own keys untouched
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "2"}
    prepare_one_gpu(cfg, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,2" and cfg.ray_kwargs.ray_init.num_cpus >= 1
    plain = compose_verl([])
    env = {}
    prepare_one_gpu(plain, env)  # another engine: nothing to do
    assert env == {} and plain.ray_kwargs.ray_init.num_cpus is None


@pytest.mark.verl
@pytest.mark.parametrize("option, agent", [("interleave", True), ("observe", False)])
@pytest.mark.parametrize("order", [1, -1])
def test_the_option_combines_with_time_slicing_as_a_list_and_the_preflight_prepares_ray(option, agent, order):
    """One GPU and time-slicing together, as a user writes it: ``+timeslice=[one_gpu,interleave]`` (either order)."""
    from timeslice_verl.adapters.preflight import preflight

    cfg = compose_verl([f"+timeslice=[{','.join(['one_gpu', option][::order])}]"])
    check_keys(cfg)
    assert cfg.timeslice.enabled is True and ("agent" not in cfg.timeslice.plugins.disabled) is agent
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == BACKEND
    if agent:  # interleave's own verl keys stay beside one_gpu's
        assert cfg.async_training.trigger_parameter_sync_step == 1
        assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB == cfg.timeslice.job
    env: dict[str, str] = {}
    prepare_one_gpu(cfg, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,0"
    preflight(cfg)  # the whole launcher check passes it


@pytest.mark.verl
@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref.hybrid_engine"),
    ("rollout.n_gpus_per_node=2", "rollout.n_gpus_per_node"),
    ("ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_gpus"),
    ("actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=null",
     "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"),
])
def test_a_changed_key_of_the_option_is_refused_before_launch_with_a_clear_message(override, key, capsys):
    from timeslice_verl.adapters.preflight import ConfigRefused, wrap_run_ppo

    cfg = compose_verl(["+timeslice=one_gpu", override])
    launched = []
    with pytest.raises(ConfigRefused) as refused:
        wrap_run_ppo(lambda *a, **k: launched.append(a), None, (cfg,), {})
    message = str(refused.value)
    assert message.startswith(f"timeslice refused this config before starting verl: {key}: is ")
    assert f"needs {ONE_GPU_KEYS[key]!r}" in message and "+timeslice=one_gpu" in message
    assert launched == []


@pytest.mark.verl
def test_a_misspelt_option_is_refused_by_hydra_listing_the_options():
    with pytest.raises(Exception) as refused:
        compose_verl(["+timeslice=one-gpu"])
    assert "one_gpu" in str(refused.value) and "one-gpu" in str(refused.value)


def test_buckets_are_allocated_outside_expandable_segments_and_the_setting_comes_back():
    torch = pytest.importorskip("torch")
    from timeslice_verl.weights_ipc.transport import _plain_segments

    before = torch._C._accelerator_getAllocatorSettings()
    try:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
        with _plain_segments(torch):
            assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:False"
        assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:True"
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
        with _plain_segments(torch):
            assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:False"
        assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:False"
    finally:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")


def test_a_handle_opens_on_the_receivers_own_index_of_the_gpu():
    from timeslice_verl.weights import WeightsError
    from timeslice_verl.weights_ipc.transport import _on_device

    args = ("cls", (4,), (1,), 0, "storage", "uint8", 3, b"handle", 4, 0, False, b"rc", 0, b"ev", True)
    assert _on_device(args, 0) == args[:6] + (0,) + args[7:]
    with pytest.raises(WeightsError, match="IPC handle layout"):
        _on_device(args[:6] + ("cuda:3",) + args[7:], 0)
