"""verl's validation set as a batch of the batch service, and its answers scored as verl scores them.

The set is verl's own (``data.val_files``: parquet rows of ``data_source``, ``prompt`` — chat messages —
``reward_model.ground_truth`` and ``extra_info``); each prompt becomes one ``/v1/chat/completions`` line (the policy
tenant applies the model's chat template, as verl's rollout does) with verl's validation sampling
(``actor_rollout_ref.rollout.val_kwargs``: ``n`` answers, greedy unless ``do_sample``) and at most
``data.max_response_length`` tokens. Answers are scored with the reward function verl is configured with
(``reward.custom_reward_function``, else verl's ``default_compute_score``) and summarised by verl's own
``process_validation_metrics`` into the keys verl logs (``val-core/…``, ``val-aux/…``). verl is imported lazily.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

CUSTOM_ID = "val-{version}-{uid}"


@dataclass(frozen=True)
class Prompt:
    uid: str
    data_source: str
    messages: list[dict[str, str]]
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sampling:
    """verl's validation sampling (``val_kwargs``) and length."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512

    @classmethod
    def of(cls, config: Any) -> Sampling:
        """From a verl config (DictConfig or dict)."""
        val = verl_value(config, "actor_rollout_ref.rollout.val_kwargs") or {}
        sample = bool(verl_value(val, "do_sample", False))
        return cls(n=int(verl_value(val, "n", 1) or 1), temperature=float(verl_value(val, "temperature", 0.0)) if sample else 0.0,
                   top_p=float(verl_value(val, "top_p", 1.0)) if sample else 1.0,
                   top_k=int(verl_value(val, "top_k", -1)) if sample else -1,
                   max_tokens=int(verl_value(config, "data.max_response_length", 512) or 512))


def verl_value(obj: Any, dotted: str, default: Any = None) -> Any:
    """``obj``'s value at a dotted key (a verl config: DictConfig, dict or object), else ``default``."""
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = obj.get(part) if hasattr(obj, "get") else getattr(obj, part, None)
    return default if obj is None else obj


def prompts_of(rows: Iterable[dict[str, Any]]) -> list[Prompt]:
    """verl's parquet rows as prompts (uids: their row numbers); a row without chat messages is refused by number."""
    out = []
    for i, row in enumerate(rows):
        messages = row.get("prompt")
        if hasattr(messages, "tolist"):
            messages = messages.tolist()
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"validation row {i}: 'prompt' is not a list of chat messages: {str(messages)[:80]}")
        reward = row.get("reward_model") or {}
        out.append(Prompt(str(i), str(row.get("data_source") or "unknown"),
                          [{"role": str(m["role"]), "content": str(m["content"])} for m in messages],
                          reward.get("ground_truth") if isinstance(reward, dict) else None,
                          dict(row.get("extra_info") or {})))
    return out


def read_valset(files: str | Sequence[str]) -> list[Prompt]:
    """``data.val_files`` (one parquet file or several)."""
    import pandas as pd

    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise ValueError("data.val_files names no file: nothing to validate on")
    frame = pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
    return prompts_of(frame.to_dict("records"))


def batch_lines(prompts: Sequence[Prompt], version: int, model: str, sampling: Sampling) -> Iterator[str]:
    """One chat line per prompt (``n`` answers each), its custom_id naming the version and the prompt."""
    for p in prompts:
        body = {"model": model, "messages": p.messages, "n": sampling.n, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        yield json.dumps({"custom_id": CUSTOM_ID.format(version=version, uid=p.uid), "method": "POST",
                          "url": "/v1/chat/completions", "body": body}) + "\n"


Scorer = Callable[..., Any]


def scorer(config: Any) -> Scorer:
    """The reward function verl is configured with (its custom one, else ``default_compute_score``)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    custom = get_custom_reward_fn(config) if verl_value(config, "reward.custom_reward_function.path") else None
    return custom or default_compute_score


def scored(prompts: Sequence[Prompt], version: int, answers: Iterable[dict[str, Any]], score: Scorer) -> dict[str, Any]:
    """Every answer of ``version``'s run scored: ``data_sources``, ``uids`` and ``infos`` (``reward`` and what a
    reward function returns beside it), one entry per answer, as verl's metrics take them. Lines of another version
    are refused (a run never mixes versions)."""
    by_uid = {p.uid: p for p in prompts}
    prefix = CUSTOM_ID.format(version=version, uid="")
    sources, uids, infos = [], [], {"reward": []}  # type: ignore[var-annotated]
    for line in answers:
        cid = str(line.get("custom_id", ""))
        if not cid.startswith(prefix) or cid[len(prefix):] not in by_uid:
            raise ValueError(f"answer {cid!r} is not of version {version}'s validation run")
        prompt = by_uid[cid[len(prefix):]]
        body = ((line.get("response") or {}).get("body") or {}) if not line.get("error") else {}
        for choice in body.get("choices") or [{"message": {"content": ""}}]:  # a failed line scores as an empty answer
            text = ((choice.get("message") or {}).get("content")) or ""
            value = score(data_source=prompt.data_source, solution_str=text, ground_truth=prompt.ground_truth,
                          extra_info=prompt.extra_info)
            extra = value if isinstance(value, dict) else {"score": value}
            infos["reward"].append(float(extra["score"]))
            for key, v in extra.items():
                if key != "score":
                    infos.setdefault(key, []).append(v)
            sources.append(prompt.data_source)
            uids.append(prompt.uid)
    return {"data_sources": sources, "uids": uids, "infos": infos}


def metrics(scores: dict[str, Any]) -> dict[str, float]:
    """verl's validation metrics (``val-core/<source>/<var>/mean@N`` …) from :func:`scored`'s lists."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    if not scores["uids"]:
        return {}
    # verl's own summary (a method that reads nothing of its trainer): the same keys verl's validation logs
    got = RayPPOTrainer._val_metrics_update(None, np.array(scores["data_sources"]), scores["uids"],  # type: ignore[arg-type]
                                            scores["infos"], [])
    return {k: float(v) for k, v in got.items()}


__all__ = ["CUSTOM_ID", "Prompt", "Sampling", "Scorer", "batch_lines", "metrics", "prompts_of", "read_valset",
           "scored", "scorer", "verl_value"]
