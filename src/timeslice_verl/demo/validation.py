"""Validation in the demo's valleys: the trainer holds a model whose weights change at every step, and at
every due version the real validation path — :func:`timeslice_verl.validate.setup.submit`, as the verl adapters call
it — pushes them into a policy tenant beside the batch tenant and runs a validation set there as batch work.

* **The model**: on a GPU, the Hugging Face model in ``--policy-model`` (the one the policy tenant serves), in this
  process; each step adds seeded noise to every weight (a stand-in for an optimizer step). In the dry run, a small
  CPU module; the stand-in vLLM loads no tensors, so its updates carry names, shapes and a checksum per tensor
  instead of CUDA IPC handles.
* **The validation set**: gsm8k-shaped rows written as verl's ``data.val_files`` (``data_source`` ``openai/gsm8k``,
  so verl's own rule reward scores them); its metrics are verl's ``val-core/…`` keys, logged by the demo's tracker at
  each version's step (its summary's ``validation``).
* **The weight source** for ``timeslice.validate.source``: :func:`source`, the demo trainer's model.
"""

from __future__ import annotations

import base64
import hashlib
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from timeslice_verl.log import get_logger
from timeslice_verl.weights import Update, ipc_updates

log = get_logger("demo")

SOURCE = "timeslice_verl.demo.validation:source"
NOISE = 1e-3
"""Each step's noise, relative to a weight's own scale."""


def write_valset(path: Path, rows: int = 16, seed: int = 0) -> Path:
    """``rows`` gsm8k-shaped questions as verl's validation parquet (``prompt``, ``reward_model.ground_truth``)."""
    import pandas as pd

    rng = random.Random(seed)
    data = []
    for i in range(rows):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        data.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {b}? "
                                                                 "End with '#### ' and the number."}],
                     "reward_model": {"ground_truth": str(a + b), "style": "rule"}, "extra_info": {"index": i}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(data).to_parquet(path)
    return path


def trainer_config(val_file: Path, every: int, max_tokens: int) -> dict[str, Any]:
    """What validation reads of verl's config: the set, the due versions, greedy sampling, the answers' length."""
    return {"data": {"val_files": [str(val_file)], "max_response_length": max_tokens},
            "trainer": {"test_freq": every},
            "actor_rollout_ref": {"rollout": {"val_kwargs": {"do_sample": False, "n": 1}}}}


@dataclass
class Tracker:
    """verl's tracker as the demo keeps it: every ``log(data, step)`` it was given."""

    logged: list[dict[str, Any]] = field(default_factory=list)

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append({"step": step, **data})


class DemoModel:
    """The weights the demo trainer holds and changes at every step."""

    def __init__(self, model_dir: str = "", device: str = "cpu", seed: int = 0) -> None:
        import torch

        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # on the GPU: a step's noise stays there
        if model_dir:
            from transformers import AutoModelForCausalLM

            self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        else:  # the dry run: a small module (the stand-in loads no tensors)
            self.module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(device)

    def named(self) -> Iterator[tuple[str, Any]]:
        return ((n, p.detach()) for n, p in self.module.named_parameters())

    def step(self) -> None:
        """An optimizer step's stand-in: seeded noise on every weight, in place."""
        import torch

        with torch.no_grad():
            for _, p in self.module.named_parameters():
                noise = torch.randn(p.shape, generator=self.generator, device=p.device, dtype=torch.float32)
                p.add_((noise * (NOISE * p.detach().float().abs().mean() + 1e-12)).to(p.dtype))


class DemoSnapshot:
    """One version's weights, copied on the trainer's thread and kept until pushed (the next step changes them)."""

    def __init__(self, version: int, tensors: list[tuple[str, Any]]) -> None:
        self.version, self.tensors = version, tensors

    def updates(self) -> Iterable[Update]:
        if self.tensors and self.tensors[0][1].is_cuda:
            return ipc_updates(self.tensors)
        return [_described(self.tensors)]

    def release(self) -> None:
        self.tensors = []


def _described(tensors: list[tuple[str, Any]]) -> Update:
    """The dry run's update: names, dtypes, shapes, and a checksum per tensor where a GPU sends IPC handles."""
    sums = {n: hashlib.sha256(t.float().numpy().tobytes()).hexdigest()[:16] for n, t in tensors}
    return Update({"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in tensors],
                   "shapes": [list(t.shape) for _, t in tensors], "packed": False,
                   "ipc_handles_pickled": base64.b64encode(pickle.dumps(sums)).decode()},
                  sum(t.numel() * t.element_size() for _, t in tensors))


@dataclass
class DemoSource:
    """``timeslice.validate.source`` for the demo: snapshots of the trainer's model."""

    model: DemoModel

    def snapshot(self, version: int) -> DemoSnapshot:
        return DemoSnapshot(version, [(n, t.clone()) for n, t in self.model.named()])


def equip(trainer: Any, out: Path, every: int, model_dir: str, device: str, seed: int) -> None:
    """The demo trainer as validation reads it: verl's config, a tracker, and a model that changes every step."""
    max_tokens = 64 if model_dir else 24
    trainer.config = trainer_config(write_valset(out / "val.parquet", seed=seed), every, max_tokens)
    trainer.logger = Tracker()
    trainer.model = DemoModel(model_dir, device, seed)


def overrides(policy_url: str, service_url: str, key_file: Path) -> list[str]:
    """The ``timeslice.validate`` settings of the demo's run (every: verl's ``trainer.test_freq``)."""
    return ["timeslice.validate.enable=true", f"timeslice.validate.policy_url={policy_url}",
            f"timeslice.validate.service_url={service_url}", f"timeslice.validate.source={SOURCE}",
            f"timeslice.batch.key_file={key_file}", "timeslice.validate.poll_s=0.5"]


def synced(trainer: Any, lc: Any) -> None:
    """After a weight sync, as the adapters' validation seam does: what ended is logged, a due version submitted."""
    from timeslice_verl.validate.setup import flush, submit

    flush(trainer)
    submit(trainer, lc, int(trainer.current_param_version))


def finish(trainer: Any, wait_s: float) -> dict[str, Any]:
    """Let the last runs end (up to ``wait_s``), log what came in; the runs and what the tracker got."""
    from timeslice_verl.validate.setup import close_validator, validator_of

    validator = validator_of(trainer)
    close_validator(trainer, wait_s)
    runs = list(validator.runs) if validator is not None else []
    return {"runs": [{"version": r.version, "status": r.status, "answers": r.answers, "push_s": round(r.push_s, 3),
                      "seconds": round(r.seconds, 3), "error": r.error} for r in runs],
            "late": [{"version": x.version, "due": x.due, "superseded": x.superseded}
                     for x in (validator.schedule.late if validator is not None else [])],
            "logged": trainer.logger.logged}


def source(trainer: Any) -> DemoSource:
    """The factory ``timeslice.validate.source`` names (called with the trainer)."""
    model = getattr(trainer, "model", None)
    if model is None:
        raise RuntimeError("the demo trainer holds no model: validation needs --validate-every with a policy tenant")
    return DemoSource(model)


__all__ = ["SOURCE", "DemoModel", "DemoSnapshot", "DemoSource", "Tracker", "equip", "finish", "overrides", "source",
           "synced", "trainer_config", "write_valset"]
