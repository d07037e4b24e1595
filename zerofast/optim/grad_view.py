"""GradWindow: what a managed parameter's `.grad` is to torch between a step's last backward and
step() ([Note: the model stays a torch model] in zerofast/guard/__init__.py).

The window opens when the step's last backward (outside no_sync()) ends and closes when the step ends,
zero_grad() runs or another backward starts. While open, each trainable parameter's `.grad` reads as a
ShardedGrad (zerofast/guard/grads.py) standing for the averaged, unscaled gradient DDP would hold, and
the window does what torch's clip functions ask over this rank's reduced shard:
  - norms: phase 2 first (as opt.clip_grad_norm_() starts), then each parameter's |g|^p summed over
    this rank's pieces (max for inf) and one small all_reduce over the shard group; divided by N times
    the loss scale, times the clip coefficients so far, as the fused kernel will see it;
  - scale and clamp: on this rank's pieces, in place, after phase 2 (no reduce may still write them);
    a clamp bound is carried into the shard's units (summed over N ranks, loss-scaled), as
    opt.clip_grad_value_() does.
So torch.nn.utils.clip_grad_norm_(model.parameters(), m) returns the global norm (opt.clip_grad_norm_(m)'s
up to the order of the sums) and scales what the step will use.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from ..comm import BucketComm
from ..errors import ShardedGradientError
from ..guard.grads import ShardedGrad
from ..guard.params import ParamSlot
from .grads import Prepared
from .precision import LossScaler
from .state import ShardState

__all__ = ["GradWindow"]


class GradWindow:
    """One optimizer's gradient window: guard.params.GradView and guard.grads.GradShards over its shard."""

    def __init__(self, who: str, shard: ShardState, comm: BucketComm, scaler: LossScaler, divisor: Callable[[], int]):
        """divisor: what the step divides the summed gradient by (Topology.divisor)."""
        self.who, self.shard, self.comm, self.scaler, self.divisor = who, shard, comm, scaler, divisor
        self.open = False
        # Phase 2, the front's (it runs the checks), held weakly: the model's stage-3 hooks reach this
        # window through the slots, and must not keep the optimizer alive.
        self.prepare: weakref.WeakMethod | None = None
        self.slots: list[ParamSlot] = []
        self._pieces: dict[int, list] = {}
        for pc in shard.pieces:
            self._pieces.setdefault(pc.param, []).append(pc)
        self._proxies: dict[int, ShardedGrad] = {}
        self._norms: dict[float, torch.Tensor] = {}

    def attach(self, slots: list[ParamSlot]) -> None:
        self.slots = slots
        for slot in slots:
            slot.grads = self

    def open_window(self) -> None:
        if not self.open:
            self.open = True
            for slot in self.slots:
                slot.refresh()

    def close_window(self) -> None:
        if self.open:
            self.open = False
            self._proxies.clear()
            self._norms.clear()
            for slot in self.slots:
                slot.refresh()

    # --- guard.params.GradView ------------------------------------------------------------------------

    def grad(self, slot: ParamSlot) -> ShardedGrad:
        proxy = self._proxies.get(slot.index)
        if proxy is None:
            proxy = self._proxies[slot.index] = ShardedGrad(self, slot.index, slot.name, slot.param)
        return proxy

    def set_grad(self, slot: ParamSlot, value) -> None:
        if value is None:
            raise RuntimeError(
                f"{self.who}: {slot.name}.grad = None (model.zero_grad()) between backward and step(): this step's "
                "gradients are already being reduced across ranks and would still be applied; call step() first "
                "(and zero the gradients at the start of an iteration)"
            )
        raise ShardedGradientError(
            f"{self.who}: {slot.name}.grad was assigned between backward and step(); the step uses the reduced "
            "gradient, of which each rank holds its shard, and would ignore it"
        )

    # --- guard.grads.GradShards -----------------------------------------------------------------------

    def norms(self, indices: list[int], ord: float) -> list[torch.Tensor]:
        prep = self._prepared()
        norms = self._norms.get(ord)
        if norms is None:
            norms = self._norms[ord] = self._global_norms(prep, ord)
        return [norms[i] for i in indices]

    def scale_(self, indices: list[int], factor) -> None:
        self._prepared()
        views = self._views(indices)
        if views:
            if isinstance(factor, torch.Tensor):
                factor = factor.to(views[0].device)
            torch._foreach_mul_(views, factor)
        self._norms.clear()

    def clamp_(self, indices: list[int], low, high) -> None:
        prep = self._prepared()
        # The shard holds the gradient summed over the ranks and loss-scaled, before the clip so far.
        units = self.divisor() * self.scaler.scale / prep.grad_factor
        low = None if low is None else low * units
        high = None if high is None else high * units
        for view in self._views(indices):
            view.clamp_(min=low, max=high)
        self._norms.clear()

    # --- the shard --------------------------------------------------------------------------------------

    def _prepared(self) -> Prepared:
        prepare = self.prepare() if self.prepare is not None else None
        if prepare is None:
            raise RuntimeError(f"{self.who}: the optimizer these gradients belong to is gone")
        return prepare()

    def _views(self, indices: list[int]) -> list[torch.Tensor]:
        """This rank's pieces of the parameters' reduced gradients (live views)."""
        shard, out = self.shard, []
        for i in indices:
            for pc in self._pieces.get(i, ()):
                out.append(
                    shard.grad_range(pc.bucket, pc.bucket_offset, slice(pc.state_offset, pc.state_offset + pc.numel))
                )
        return out

    def _global_norms(self, prep: Prepared, ord: float) -> torch.Tensor:
        """Every trainable parameter's global `ord`-norm (float32, on the shard's device): its pieces'
        sums of |g|^ord (max |g| for inf) over this rank, one all_reduce over the shard group."""
        if ord == -math.inf or ord < 0:
            raise ShardedGradientError(f"{self.who}: a gradient norm of order {ord} over sharded gradients")
        n = len(self.slots)
        device = self.shard.grad_shard.device
        acc = torch.zeros(n, dtype=torch.float32, device=device)
        for i, pieces in self._pieces.items():
            if not prep.used[i]:
                continue  # no gradient anywhere: as torch skips a parameter whose .grad is None
            for pc in pieces:
                g = self.shard.grad_range(
                    pc.bucket, pc.bucket_offset, slice(pc.state_offset, pc.state_offset + pc.numel)
                )
                if ord == math.inf:
                    acc[i] = torch.maximum(acc[i], g.abs().max().float())
                elif ord == 0:
                    acc[i] += (g != 0).sum()
                else:
                    acc[i] += torch.linalg.vector_norm(g, ord, dtype=torch.float32) ** ord
        if ord == math.inf:
            self.comm.all_reduce_max(acc)
        else:
            self.comm.all_reduce_sum(acc)
        if ord == 0:
            return acc
        norms = acc if ord == math.inf else acc ** (1.0 / ord)
        factor = prep.grad_factor
        scale = self.divisor() * self.scaler.scale
        if isinstance(factor, torch.Tensor):
            return norms * (factor.abs().float() / scale)
        return norms * (abs(factor) / scale)
