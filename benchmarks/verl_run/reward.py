"""A rule reward a randomly initialised model can earn, for validated runs that learn something.

verl's gsm8k rule gives a random model 0 on every response, so GRPO's advantages and ``actor/grad_norm`` are 0
and a time-sliced run cannot be compared with a solo one on a learning curve. This reward is the share of
digits in the response: random responses differ in it (non-zero advantages), and a policy that writes more
digits earns more, so the score climbs as the actor trains. Pass it to verl with
``reward.custom_reward_function.path=benchmarks/verl_run/reward.py`` (``name`` defaults to ``compute_score``).
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Any = None,
                  **kwargs: Any) -> float:
    """Digits per character of the response, in [0, 1]; 0 for an empty response."""
    text = solution_str or ""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
