"""ShardState: this rank's part of the training state, and where each piece of it sits.

It owns the flat parameter buffers (one per bucket; the model's parameters are views of them), the
reduced gradient shard, the fp32 master (in mixed precision a shard of its own; in fp32 the owned
ranges of the parameter buffers, or stage 3's parameter shard, are the master), exp_avg,
exp_avg_sq and the per-parameter step counts, and the layout's pieces that address them: piece k
is (parameter, offset into the flattened parameter, numel) at `state_offset` in the shard buffers
and `bucket_offset` in its bucket. Phase 3 of a step (the fused Adam update) runs here, over it.
Checkpoints read it through the accessors below (the optimizer's checkpoint view binds them), and
reports through nbytes(), never through its tensors' names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import _ops
from ..config import Plan
from ..layout import Layout, Piece, bind_views


@dataclass(frozen=True)
class Run:
    """A contiguous range of this rank's shard that one fused_adam_ call updates."""

    bucket: int  # which parameter buffer
    bucket_lo: int  # first element inside that buffer
    state_lo: int  # first element inside the shard buffers (grads, exp_avg, exp_avg_sq)
    numel: int
    group: int  # parameter group index
    params: tuple[int, ...]  # the parameters it touches (their step counts advance together)


class ShardState:
    def __init__(self, layout: Layout, rank: int, names: list[str], params: list[torch.nn.Parameter], plan: Plan):
        """Build the buffers and make every parameter in `params` a view of its slot; the fp32
        master starts from the parameters' values as given (the user's exact fp32 values). What
        exists follows the plan: plan.params_sharded (stage 3) keeps the parameters in a shard of
        their own between uses; plan.grads_as_bucket_views (stage 1) keeps the gradients in
        persistent buckets that .grad are views of, the reduce leaving the owned range in place, so
        there is no separate gradient shard ([Note: grads as bucket views] in csrc/buckets.cpp);
        plan.separate_master (low-precision parameters) keeps an fp32 master shard."""
        self.plan = plan
        self.layout, self.rank, self.names = layout, rank, names
        device = params[0].device
        dtype, reduce_dtype, grad_views = plan.param_dtype, plan.reduce_dtype, plan.grads_as_bucket_views
        mixed = plan.separate_master
        shard = layout.shard_numel(rank)
        self.param_buffers = [torch.zeros(b.numel, dtype=dtype, device=device) for b in layout.buckets]
        # Stage 1 with gradient views: the full gradients, one flat bucket each, reduced in place.
        self.grad_buckets = (
            [torch.zeros(b.numel, dtype=reduce_dtype, device=device) for b in layout.buckets] if grad_views else []
        )
        # 1D, this rank's reduced gradients (empty with grad_views: they stay in grad_buckets).
        self.grad_shard = torch.zeros(0 if grad_views else shard, dtype=reduce_dtype, device=device)
        # Stage 3's parameter shard, in the parameters' dtype, which the next forward gathers
        # (stages 1 and 2 update the owned range of the parameter buffers in place instead).
        self.param_shard = torch.zeros(shard if plan.params_sharded else 0, dtype=dtype, device=device)
        self.exp_avg = torch.zeros(shard, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(shard, dtype=torch.float32, device=device)
        self.master = torch.zeros(shard if mixed else 0, dtype=torch.float32, device=device)  # mixed only
        self.pieces: list[Piece] = layout.pieces(rank)
        self.steps = [0] * len(params)  # per parameter, as torch.optim keeps it
        originals = [p.detach() for p in params]
        bind_views(params, layout, self.param_buffers)
        with torch.no_grad():
            for pc in self.pieces if mixed else []:
                src = originals[pc.param].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
                self.master[pc.state_offset : pc.state_offset + pc.numel].copy_(src)

    # --- phase 3 --------------------------------------------------------------------------------

    def apply_adam(
        self, used: list[bool], param_groups: list[dict], group_of: list[int], adamw: bool, grad_scale: float
    ) -> None:
        """The fused AdamW step over every owned range of a used parameter, the gradient shard
        multiplied by grad_scale (1/N, unscaling and clipping together)."""
        for run in self.runs(used, group_of):
            group = param_groups[run.group]
            beta1, beta2 = group["betas"]
            state = slice(run.state_lo, run.state_lo + run.numel)
            master, copy = self.master_and_copy(run.bucket, run.bucket_lo, state)
            _ops.fused_adam_(
                master,
                self.grad_range(run.bucket, run.bucket_lo, state),
                self.exp_avg[state],
                self.exp_avg_sq[state],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=self.steps[run.params[0]] + 1,
                adamw=adamw,
                grad_scale=grad_scale,
                param_copy=copy,
            )
        self.count_steps(used)

    def count_steps(self, used: list[bool]) -> None:
        """One more step for every used parameter (the update that counted it has run)."""
        for i, u in enumerate(used):
            if u:
                self.steps[i] += 1

    def runs(self, used: list[bool], group_of: list[int]) -> list[Run]:
        """This rank's owned pieces of used parameters, merged where contiguous with equal
        (bucket, group, step count), so one kernel call covers many small tensors."""
        runs: list[Run] = []
        for pc in self.pieces:
            if not used[pc.param]:
                continue
            key = (pc.bucket, group_of[pc.param], self.steps[pc.param])
            last = runs[-1] if runs else None
            if (
                last is not None
                and (last.bucket, last.group, self.steps[last.params[0]]) == key
                and last.bucket_lo + last.numel == pc.bucket_offset
                and last.state_lo + last.numel == pc.state_offset
            ):
                runs[-1] = Run(
                    last.bucket,
                    last.bucket_lo,
                    last.state_lo,
                    last.numel + pc.numel,
                    last.group,
                    last.params + (pc.param,),
                )
            else:
                runs.append(Run(pc.bucket, pc.bucket_offset, pc.state_offset, pc.numel, key[1], (pc.param,)))
        return runs

    def grad_range(self, bucket: int, bucket_lo: int, state: slice) -> torch.Tensor:
        """The reduced gradients of an owned range (bucket `bucket` from `bucket_lo`; `state` in
        the shard buffers): in the gradient shard, or where stage 1's in-place reduce left them."""
        if self.plan.grads_as_bucket_views:
            return self.grad_buckets[bucket].narrow(0, bucket_lo, state.stop - state.start)
        return self.grad_shard[state]

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, padding included (zero), as flat tensors: the gradient
        shard, or the owned range of each of stage 1's buckets."""
        if not self.plan.grads_as_bucket_views:
            return [self.grad_shard]
        return [
            g.narrow(0, b.bounds[self.rank], b.bounds[self.rank + 1] - b.bounds[self.rank])
            for g, b in zip(self.grad_buckets, self.layout.buckets)
        ]

    def grad_views(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor] | None:
        """Each parameter's slot in stage 1's gradient buckets, shaped as the parameter (None
        without grad_views)."""
        if not self.plan.grads_as_bucket_views:
            return None
        return [
            self.grad_buckets[s.bucket].narrow(0, s.offset, s.numel).view_as(p)
            for s, p in zip(self.layout.slots, params)
        ]

    def master_and_copy(self, bucket: int, bucket_lo: int, state: slice):
        """The fp32 master of an owned range (bucket `bucket` from `bucket_lo`; `state` in the shard
        buffers), and the low-precision parameters its update is written to (None in fp32, where
        the master is the parameter)."""
        # Stage 3 keeps its parameters in the shard (the unit buffers are released by now).
        params = (
            self.param_shard[state]
            if self.plan.params_sharded
            else self.param_buffers[bucket].narrow(0, bucket_lo, state.stop - state.start)
        )
        if self.plan.separate_master:
            return self.master[state], params
        return params, None

    # --- accessors ------------------------------------------------------------------------------

    def piece_view(self, pc: Piece, kind: str) -> torch.Tensor:
        """The live 1-D values of "master", "exp_avg" or "exp_avg_sq" for one of this rank's
        pieces: a view into the state, so reading it reads the state and writing into it writes
        the state (a checkpoint's save reads these views, its load writes them; after writing the
        master, sync_params_from_master())."""
        _check_kind("piece_view", kind)
        state = slice(pc.state_offset, pc.state_offset + pc.numel)
        if kind == "master":
            return self.master_and_copy(pc.bucket, pc.bucket_offset, state)[0]
        return getattr(self, storage_of(kind))[state]

    def load_pieces(self, kind: str, full: Mapping[int, torch.Tensor]) -> None:
        """Write this rank's pieces of `kind` from whole tensors, by parameter index (each of its
        parameter's numel, any shape); parameters not in `full` keep their values."""
        _check_kind("load_pieces", kind)
        with torch.no_grad():
            for pc in self.pieces:
                if pc.param in full:
                    src = full[pc.param].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
                    self.piece_view(pc, kind).copy_(src)

    def sync_params_from_master(self) -> None:
        """After the fp32 master was written outside a step (a load): this rank's owned
        low-precision parameters become its rounding, as a step's kernel leaves them. Nothing to
        do in fp32, where the master is the parameters."""
        with torch.no_grad():
            for pc in self.pieces:
                state = slice(pc.state_offset, pc.state_offset + pc.numel)
                master, copy = self.master_and_copy(pc.bucket, pc.bucket_offset, state)
                if copy is None:
                    return
                copy.copy_(master)

    def step_counts(self) -> dict[str, int]:
        """Adam steps taken by each parameter, by name."""
        return dict(zip(self.names, self.steps))

    def set_step_counts(self, counts: Mapping[str, int]) -> None:
        """Set every parameter's step count by name (step_counts() of a saved state)."""
        missing = [n for n in self.names if n not in counts]
        if missing:
            raise ValueError(f"ShardState.set_step_counts: no step count for {missing[0]} ({len(missing)} missing)")
        self.steps[:] = [int(counts[n]) for n in self.names]

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self.exp_avg.device

    def materialized_param_bytes(self) -> int:
        """Bytes of parameter storage that exist now: the parameter buffers' storage (stage 3: only
        the units gathered at this moment; stages 1 and 2: always all) plus stage 3's own shard."""
        return (
            sum(b.untyped_storage().nbytes() for b in self.param_buffers)
            + self.param_shard.numel() * self.param_shard.element_size()
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes held now, by kind: parameters (materialized), their padding, the gradient shard,
        Adam's moments, the separate fp32 master (0 in fp32: the parameters are their own), and
        stage 1's gradient buckets (padding included), which are its full gradients."""

        def size(t):
            return t.numel() * t.element_size()

        return {
            "params": self.materialized_param_bytes(),
            "param_padding": sum(b.numel - self.layout.used_numel(b.index) for b in self.layout.buckets)
            * self.param_buffers[0].element_size(),
            "grad_shard": size(self.grad_shard),
            "optimizer": size(self.exp_avg) + size(self.exp_avg_sq),
            "master_copy": size(self.master),
            "grad_buckets": sum(size(g) for g in self.grad_buckets),
        }


KINDS = ("master", "exp_avg", "exp_avg_sq", "momentum_buffer")  # the fp32 state a piece holds, by name

# [Note: Muon's momentum in exp_avg's slot]
# ZeroMuon (zerofast/optim/muon.py) keeps each owned Muon matrix's momentum buffer (fp32, torch.optim.Muon's
# "momentum_buffer") in that matrix's range of exp_avg: the range exists anyway (the shard buffers are laid
# out over every owned element), a matrix is never updated by Adam, and so the buffer is sharded with its
# owner, staged, saved and resharded exactly as exp_avg is, by the same offsets. The cost: the matrix's
# range of exp_avg_sq stays allocated and unused (4 bytes per Muon element); a compact Adam state indexed
# apart from the shard offsets would save it, at the price of a second offset map in every reader.
_STORAGE = {"momentum_buffer": "exp_avg"}


def storage_of(kind: str) -> str:
    """The shard buffer that holds state `kind` ([Note: Muon's momentum in exp_avg's slot])."""
    return _STORAGE.get(kind, kind)


def _check_kind(where: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"ShardState.{where}: kind must be one of {', '.join(KINDS)}; got {kind!r}")
