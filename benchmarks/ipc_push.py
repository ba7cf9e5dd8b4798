"""Same-GPU CUDA IPC weight push (checkpoint engine ``timeslice_ipc``'s transport) against the GPU's own copy rate.

    python benchmarks/ipc_push.py [--gib 1] [--bucket-mib 512] [--repeats 5] [--updates 100] [--small-mib 64]
        [--record benchmarks/results/ipc-push/DATE-MACHINE [--also gpu_tests.log]]

Two processes on one GPU: this one sends, a spawned child receives and copies every tensor into weights of its own
(as vLLM does). Prints one table: the big push (bytes, seconds, GB/s; bit-exact by checksum on both sides), this
GPU's device-to-device ``copy_`` rate measured in the same run and the ratio (a push copies twice, into the bucket
and out of it, so ~0.5 is the ceiling), then ``--updates`` smaller updates with the memory of both processes
after each (torch's allocated bytes; NVML's used memory where it sees the processes). Needs torch only. ``--record``
writes the run's folder: the table as ``ipc_push.txt`` and the files ``--also`` names (the GPU tests' log).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

try:
    import timeslice_verl  # noqa: F401
except ImportError:  # a source checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from readers.common import add_record_arguments, record  # noqa: E402
from timeslice_verl.weights_ipc.pushcheck import MIB, PushRig, copy_rate  # noqa: E402

GB = 1e9


def big_push(gib: float, bucket_mib: int, repeats: int, device: int) -> dict:
    rig = PushRig(int(gib * (1 << 30)), bucket_mib * MIB, device=device)
    try:
        records = [rig.update() for _ in range(repeats)]
        exact = rig.bit_exact()
    finally:
        rig.close()
    best = min(r.push_s for r in records)
    d2d = copy_rate(rig.bytes, device)
    return {"bytes": rig.bytes, "push_s": best, "median_s": statistics.median(r.push_s for r in records),
            "update_s": min(r.update_s for r in records), "gbps": rig.bytes / best / GB, "d2d_gbps": d2d / GB,
            "ratio": rig.bytes / best / d2d, "bit_exact": exact, "records": records}


def many_updates(mib: int, bucket_mib: int, updates: int, device: int) -> dict:
    rig = PushRig(mib * MIB, bucket_mib * MIB, device=device)
    try:
        records = [rig.update() for _ in range(updates)]
        exact = rig.bit_exact()
        base = (rig.sender_baseline, rig.receiver_baseline, rig.nvml_baseline)
    finally:
        rig.close()
    return {"bytes": rig.bytes, "records": records, "bit_exact": exact, "sender_baseline": base[0],
            "receiver_baseline": base[1], "nvml_baseline": base[2]}


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.0f}"


def table(big: dict, many: dict) -> str:
    lines = ["| push | bytes | seconds (best / median) | GB/s | GPU copy_ GB/s | ratio | bit-exact |",
             "|---|---|---|---|---|---|---|",
             f"| one update | {big['bytes'] / GB:.3f} GB | {big['push_s']:.4f} / {big['median_s']:.4f} | "
             f"{big['gbps']:.1f} | {big['d2d_gbps']:.1f} | {big['ratio']:.2f} | {big['bit_exact']} |"]
    recs = many["records"]
    first, last = recs[0], recs[-1]
    pids = list(last.nvml)
    lines += ["", "| updates | bytes each | median seconds | sender allocated: base / after 1st / after last (MiB) | "
              "receiver allocated: base / after 1st / after last (MiB) | NVML used per process: base / after 1st / "
              "after last (MiB) | all closed clean | bit-exact |", "|---|---|---|---|---|---|---|---|",
              f"| {len(recs)} | {many['bytes'] / MIB:.0f} MiB | {statistics.median(r.push_s for r in recs):.4f} | "
              f"{_mib(many['sender_baseline'])} / {_mib(first.sender_allocated)} / {_mib(last.sender_allocated)} | "
              f"{_mib(many['receiver_baseline'])} / {_mib(first.receiver_allocated)} / {_mib(last.receiver_allocated)}"
              f" | " + "; ".join(f"pid {p}: {_mib(many['nvml_baseline'].get(p))} / {_mib(first.nvml.get(p))} / "
                                 f"{_mib(last.nvml.get(p))}" for p in pids)
              + f" | {all(r.sender_clean and r.receiver_clean for r in recs)} | {many['bit_exact']} |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the big push")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--small-mib", type=int, default=64, help="size of each of the many updates")
    parser.add_argument("--small-bucket-mib", type=int, default=16)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--also", type=Path, nargs="*", default=[], help="files the recorded run keeps too")
    add_record_arguments(parser)
    args = parser.parse_args()
    big = big_push(args.gib, args.bucket_mib, args.repeats, args.device)
    many = many_updates(args.small_mib, args.small_bucket_mib, args.updates, args.device)
    sys.stdout.write(table(big, many) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ipc_push.txt").write_text(table(big, many) + "\n")
        record(args, "ipc-push", [Path(tmp) / "ipc_push.txt", *args.also], f"Same-GPU CUDA IPC push: "
               f"{big['bytes'] / GB:.2f} GB in {big['push_s'] * 1e3:.1f} ms ({big['gbps']:.0f} GB/s, bit-exact "
               f"{big['bit_exact']}); {len(many['records'])} updates, bit-exact {many['bit_exact']}.")


if __name__ == "__main__":
    main()
