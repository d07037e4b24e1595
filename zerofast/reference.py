"""ZeRO stages 1, 2 and 3 in plain PyTorch: zerofast's correctness oracle.

The ZeRO paper's algorithm (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) as the Chinese-language course chapter "ZeRO 优化器"
("渐进式去冗余，从优化器状态到参数的三级分片": progressive removal of redundancy, three levels of
sharding from the optimizer state to the parameters) teaches it, simple and obviously correct rather than fast:
- owners: trainable parameter i (in `model.named_parameters()` order, so a tied weight is one
  parameter) belongs to rank i % world ("round-robin");
- the owner alone keeps AdamW state (a torch.optim.AdamW over its owned parameters);
- step(): each gradient is reduced to its owner, one `dist.reduce` per parameter; the owner steps;
  stages 1 and 2 then broadcast every parameter from its owner, one `dist.broadcast` per parameter;
- stage 1 keeps every gradient on every rank (the non-owners' hold undefined values after the
  reduce, as the chapter notes); stage 2 drops the non-owners' gradients right after the reduce;
- stage 3 also drops the non-owners' parameter data (`param.data = torch.empty(0)`) and gathers the
  whole model by broadcast before forward and again before backward, releasing it after forward
  and after step (3Φ per step: broadcast, broadcast, reduce).

Two deliberate differences from the chapter, both so the oracle equals single-process AdamW on the
global batch and runs under the same loop as ZeroAdam (`loss.backward(); opt.step(); opt.zero_grad()`):
- gradients are averaged over ranks (the chapter sums them), as DDP does;
- the ranks first agree which parameters got a gradient: a parameter with a gradient on no rank is
  left untouched (like torch.optim.AdamW with grad None); one missing on only some ranks counts as zero.
Stage 3's gathers are driven by hooks (a forward pre-hook and a hook on the forward's outputs'
gradients) instead of lines in the training loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .stage3.runtime import output_tensors

__all__ = ["ReferenceZero", "round_robin_owners"]


def round_robin_owners(names: Iterable[str], world_size: int) -> dict[str, int]:
    """Round-robin owners, the course chapter's rule: the i-th parameter belongs to rank i % world_size."""
    return {name: i % world_size for i, name in enumerate(names)}


class ReferenceZero:
    """The chapter's stage `stage` (1, 2 or 3) as an optimizer: step() and zero_grad()."""

    def __init__(
        self,
        model: nn.Module,
        stage: int,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"ReferenceZero: stage must be 1, 2 or 3; got {stage!r}")
        self.model = model
        self.stage = stage
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owner = round_robin_owners((n for n, _ in self.params), self.world_size)
        for t in list(model.parameters()) + list(model.buffers()):  # everyone starts from rank 0's
            dist.broadcast(t.data, src=self._global(0), group=process_group)
        owned = [p for n, p in self.params if self.owner[n] == self.rank]
        self.optimizer = (
            torch.optim.AdamW(owned, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
            if owned
            else None
        )
        self._full_shape = {n: p.shape for n, p in self.params}
        if stage == 3:
            self._release_params()
            model.register_forward_pre_hook(lambda module, args: self.gather_params())
            model.register_forward_hook(self._after_forward)

    # --- the training loop's calls -------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self) -> None:
        has_grad = self._agree_on_grads()
        for (name, p), any_grad in zip(self.params, has_grad):
            if any_grad:
                self._reduce_grad_to_owner(name, p)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.stage == 3:
            self._release_params()
        else:
            for name, p in self.params:
                dist.broadcast(p.data, src=self._global(self.owner[name]), group=self.group)

    # --- pieces ---------------------------------------------------------------------------------

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _is_owner(self, name: str) -> bool:
        return self.owner[name] == self.rank

    def _agree_on_grads(self) -> list[bool]:
        # On the parameters' device: NCCL reduces CUDA tensors only.
        device = self.params[0][1].device
        local = torch.tensor([float(p.grad is not None) for _, p in self.params], device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(x) for x in local.tolist()]

    def _reduce_grad_to_owner(self, name: str, p: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = torch.zeros(self._full_shape[name], dtype=p.dtype, device=p.device)
        dist.reduce(p.grad, dst=self._global(self.owner[name]), op=dist.ReduceOp.SUM, group=self.group)
        if self._is_owner(name):
            p.grad.div_(self.world_size)  # average, as DDP does (the chapter sums)
        elif self.stage >= 2:
            p.grad = None  # stage 2's one change: non-owners drop the gradient

    def gather_params(self) -> None:
        """Stage 3: every rank gets every full parameter, broadcast from its owner (the forward does
        this itself; after training, a caller does it to read the full parameters)."""
        for name, p in self.params:
            if not self._is_owner(name):
                p.data = torch.empty(self._full_shape[name], dtype=p.dtype, device=p.device)
            dist.broadcast(p.data, src=self._global(self.owner[name]), group=self.group)

    def _release_params(self) -> None:
        """Stage 3: non-owners keep an empty placeholder instead of the parameter's data."""
        for name, p in self.params:
            if not self._is_owner(name):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _after_forward(self, module, args, output) -> None:
        self._release_params()
        needs_grad = [t for t in output_tensors(output) if t.requires_grad]
        if needs_grad:  # gather again as soon as backward reaches the model's outputs
            torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda grads: self.gather_params(), mode="any")

    # --- reports --------------------------------------------------------------------------------

    def memory_held(self) -> dict[str, int]:
        """Bytes this rank holds now, counted from the tensors: parameter data, gradients, Adam moments."""
        state = self.optimizer.state.values() if self.optimizer is not None else []
        return {
            "params": sum(p.data.nbytes for _, p in self.params),
            "grads": sum(p.grad.nbytes for _, p in self.params if p.grad is not None),
            "optimizer": sum(s[k].nbytes for s in state for k in ("exp_avg", "exp_avg_sq") if k in s),
        }
