"""A stand-in trainer: an fp32 MLP with AdamW, FSDP2-sharded over the ranks when there are several.

Deterministic: the same seed, world size and step index give bit-identical losses, so a time-sliced
run can be compared with a solo one. Every step all-reduces its loss over NCCL (besides FSDP2's own
collectives) and runs ``micro`` forward/backward passes so it takes long enough to time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class StandIn:
    def __init__(self, *, width: int, depth: int, batch: int, micro: int, seed: int = 0, device: Any = "cuda") -> None:
        self.width, self.batch, self.micro, self.seed = width, batch, micro, seed
        self.device = torch.device(device)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers).to(self.device)
        if self.world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(self.model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.target = torch.randn(width, width, generator=gen).div_(width**0.5).to(self.device)
        self.steps = 0

    def _data(self, step: int, micro: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + step * 1009 + micro * 17 + self.rank)
        return torch.randn(self.batch, self.width, generator=gen, device=self.device)

    def step(self) -> tuple[float, float]:
        """One optimizer step; (loss over all ranks, seconds)."""
        self._sync()
        t0 = time.perf_counter()
        self.optim.zero_grad(set_to_none=False)
        total = torch.zeros((), device=self.device)
        for m in range(self.micro):
            x = self._data(self.steps, m)
            loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target) / self.micro
            loss.backward()
            total += loss.detach()
        self.optim.step()
        if self.world > 1:
            dist.all_reduce(total)
            total /= self.world
        value = float(total.item())
        self._sync()
        self.steps += 1
        return value, time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state held by this rank."""
        seen: dict[int, int] = {}
        tensors = [*self.model.parameters(), *(p.grad for p in self.model.parameters() if p.grad is not None)]
        tensors += [v for s in self.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            local = getattr(t, "_local_tensor", t)
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def snapshot(self) -> list[torch.Tensor]:
        """Host copies of every parameter and optimizer-state tensor (for bit-identity checks)."""
        out = [getattr(p, "_local_tensor", p).detach().cpu().clone() for p in self.model.parameters()]
        for state in self.optim.state.values():
            out += [getattr(v, "_local_tensor", v).detach().cpu().clone() for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def identical_to(self, snap: list[torch.Tensor]) -> bool:
        now = self.snapshot()
        return len(now) == len(snap) and all(torch.equal(a, b) for a, b in zip(now, snap))

    def close(self) -> None:
        del self.model, self.optim, self.target
