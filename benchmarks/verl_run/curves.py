"""The learning curves of two or more verl runs in one plot: reward and gradient norm per training step.

usage: python benchmarks/verl_run/curves.py OUT.png RUN_DIR [RUN_DIR ...]
Reads each run's verl.log (verl's console logger, ``step:N - key:value - …``); writes OUT.png and OUT.json
(the per-step values behind it). A time-sliced run should follow its solo twin within the noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize import verl_steps  # noqa: E402

KEYS = (("critic/score/mean", "reward (mean score)"), ("actor/grad_norm", "actor grad norm"))


def curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    steps = verl_steps((run / "verl.log").read_text(errors="replace"))
    return {key: [(n, f[key]) for n, f in sorted(steps.items()) if key in f] for key, _ in KEYS}


def plot(out: Path, runs: list[Path]) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {run.name: curves(run) for run in runs}
    fig, axes = plt.subplots(1, len(KEYS), figsize=(5 * len(KEYS), 3.5))
    for ax, (key, label) in zip(axes, KEYS):
        for name, series in data.items():
            if series[key]:
                ax.plot(*zip(*series[key]), marker="o", label=name)
        ax.set_xlabel("training step")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    data = plot(args.out, args.runs)
    for name, series in data.items():
        print(name, {k: len(v) for k, v in series.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
