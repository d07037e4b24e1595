"""ShardState: this rank's part of the training state, where each piece of it sits, and phase 3 over it.

It owns the flat parameter buffers (one per bucket; the model's parameters view them), the reduced
gradient shard, the fp32 master (in mixed precision a shard of its own; in fp32 the owned ranges of the
parameter buffers, or stage 3's parameter shard), exp_avg, exp_avg_sq (fp32, or 8-bit codes with
per-block scales: [Note: quantized state] in zerofast/quant.py), the step counts, and the layout's
pieces that address them: (parameter, offset into the flattened parameter, numel) at `state_offset` in
the shard buffers and `bucket_offset` in its bucket. Checkpoints read it through the accessors (the
checkpoint view binds them), reports through nbytes(), never through its tensors' names.
Notes here: [Note: one kernel per range], [Note: block tails], [Note: Muon's momentum in exp_avg's slot].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import _ops
from ..config import Plan
from ..layout import Layout, Piece, bind_views
from ..quant import block_slice, code_of, dequantize, dynamic_code, num_blocks, quantize, scale_kind, thresholds


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
    def __init__(
        self,
        layout: Layout,
        rank: int,
        names: list[str],
        params: list[torch.nn.Parameter],
        plan: Plan,
        store,
        files=None,
        meta_device: torch.device | None = None,
    ):
        """Build the buffers and make every parameter in `params` a view of its slot; the fp32 master
        starts from the user's exact values. plan.params_sharded (stage 3) keeps the parameters in a
        shard of their own between uses; plan.grads_as_bucket_views (stage 1) keeps the gradients in
        persistent buckets that .grad views, reduced in place, with no separate gradient shard
        ([Note: grads as bucket views] in csrc/buckets.cpp); plan.separate_master keeps an fp32
        master shard. The master and moments are `store`'s tensors (zerofast/offload: on the device,
        in host memory or in files), wherever it put them; `files` (stage 3, OffloadPolicy(params=
        "disk")) holds the parameter and gradient shards ([Note: parameters on disk]). meta_device: the
        parameters are on the meta device and train there ([Note: models built on the meta device] in
        zerofast/model_setup.py): nothing is copied, the buffers are allocated untouched, the master is zero."""
        self.plan = plan
        self.layout, self.rank, self.names = layout, rank, names
        self.meta = meta = meta_device is not None
        device = meta_device if meta else params[0].device
        dtype, reduce_dtype, grad_views = plan.param_dtype, plan.reduce_dtype, plan.grads_as_bucket_views
        shard = layout.shard_numel(rank)
        alloc = torch.empty if meta else torch.zeros  # untouched pages are not resident: stage 3 releases them
        self.param_buffers = [alloc(b.numel, dtype=dtype, device=device) for b in layout.buckets]
        # Stage 3's parameter shard, in the parameters' dtype, which the next forward gathers
        # (stages 1 and 2 update the owned range of the parameter buffers in place instead).
        self.files = files
        self._store_let_go = getattr(store, "let_go", None)  # a store on disk: its mapped pages
        self.param_shard = (
            files.tensors["param_shard"]
            if files is not None
            else torch.zeros(shard if plan.params_sharded else 0, dtype=dtype, device=device)
        )
        # The moments: fp32, or 8-bit (one code index per element, one fp32 scale per block, block k
        # at state offsets [k * block, (k + 1) * block): [Note: quantized state]). Offloaded, the
        # master is a tensor of its own: the parameters stay with the model, and a failed step is
        # undone from the master.
        self.offloaded = store.offloaded  # its tensors are not the model's device's: counted by the store
        # Shards in files too (zerofast/offload/update.py's [Note: the all-or-none step with the state
        # in memory]): the step writes the parameter file before the ranks agree, and the master holds
        # the values a failed step goes back to.
        self.master_apart = plan.separate_master or self.offloaded or files is not None
        # Stages 1 and 2: the parameters the model holds are written by users too (nn.init,
        # load_state_dict); the master follows them in the step's kernel ([Note: the master follows
        # the copy] in csrc/adam_math.h) and in follow_params(). Stage 3's writes reach the master
        # directly (follow_shard: [Note: the model stays a torch model] in zerofast/guard/__init__.py).
        self.follows_params = self.master_apart and not plan.params_sharded
        self.bind(store.views())
        state_device = self.exp_avg.device
        self.codes = (
            (dynamic_code(True).to(state_device), dynamic_code(False).to(state_device))
            if plan.quantized_state
            else None
        )
        self.pieces: list[Piece] = layout.pieces(rank)
        self.steps = [0] * len(params)  # per parameter, as torch.optim keeps it
        # The master starts from the values as given: a parameter already in the buffers' dtype is
        # read back from its slot, so that its own storage is freed as it is rebound (building holds
        # the model's parameters once, not twice); one in another dtype (fp32 given, bf16 buffers)
        # is kept until its master is written.
        originals = [p.detach() if self.master_apart and p.dtype != dtype and not meta else None for p in params]
        bind_views(params, layout, self.param_buffers)
        with torch.no_grad():
            for pc in self.pieces if self.master_apart and not meta else []:
                if originals[pc.param] is None:
                    src = self.param_buffers[pc.bucket].narrow(0, pc.bucket_offset, pc.numel)
                else:
                    src = originals[pc.param].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
                store.write("master", pc.state_offset, src)  # on disk through the files: no page stays resident
        del originals
        # The gradient buffers come last, once the parameters' own storage is freed (above): stage 1's
        # full gradients, one flat bucket each, reduced in place; or this rank's reduced gradient shard.
        self.grad_buckets = (
            [torch.zeros(b.numel, dtype=reduce_dtype, device=device) for b in layout.buckets] if grad_views else []
        )
        self.grad_shard = (
            files.tensors["grad_shard"]
            if files is not None
            else torch.zeros(0 if grad_views else shard, dtype=reduce_dtype, device=device)
        )

    def let_go(self, lo: int = 0, numel: int | None = None) -> None:
        """Shards and state in files: the mapped pages of shard elements [lo, lo + numel) (None: all)
        leave resident memory ([Note: parameters on disk] in zerofast/offload/__init__.py)."""
        if self.files is not None:
            for name in ("param_shard", "grad_shard"):
                self.files.let_go(name, lo, numel)
        if self._store_let_go is not None:
            self._store_let_go(lo, numel)

    @staticmethod
    def storage_of(kind: str) -> str:
        """The shard buffer that holds state `kind` (storage_of)."""
        return storage_of(kind)

    def bind(self, views: Mapping[str, torch.Tensor]) -> None:
        """The state's tensors, by name (master, exp_avg, ...): the store's, now (a store on disk
        switches generations at each committed step)."""
        for name, t in views.items():
            setattr(self, name, t)

    # --- phase 3 --------------------------------------------------------------------------------

    def apply_adam(
        self,
        used: list[bool],
        param_groups: list[dict],
        group_of: list[int],
        adamw: bool,
        grad_scale: float | torch.Tensor,
    ) -> None:
        """The fused AdamW step over every owned range of a used parameter, the gradient times grad_scale
        (1/N, unscaling and clipping); an offloaded store steps it through zerofast/offload/update.py instead."""
        for run in self.runs(used, group_of):
            state = slice(run.state_lo, run.state_lo + run.numel)
            master, copy = self.master_and_copy(run.bucket, run.bucket_lo, state)
            views = {name: getattr(self, name)[s] for name, s in self._state_slices(state).items()}
            views["master"] = master
            grad = self.grad_range(run.bucket, run.bucket_lo, state)
            follow = self.follows_params and copy is not None
            self.step_range(
                views, grad, param_copy=copy, follow_copy=follow, **self.hyper(run, param_groups, adamw, grad_scale)
            )
            self.let_go(run.state_lo, run.numel)
        self.count_steps(used)

    def step_range(self, views: Mapping[str, torch.Tensor], grad: torch.Tensor, **kw) -> None:
        """The one kernel call over a range of the state (its tensors by name, as a store hands them
        out): fused Adam, or its 8-bit form."""
        if self.plan.quantized_state:
            moments = (views["exp_avg"], views["exp_avg_sq"], views["exp_avg_scale"], views["exp_avg_sq_scale"])
            _ops.fused_adam_8bit_(views["master"], grad, *moments, *self.codes, block=self.plan.state_block, **kw)
        else:
            _ops.fused_adam_(views["master"], grad, views["exp_avg"], views["exp_avg_sq"], **kw)

    def _state_slices(self, state: slice) -> dict[str, slice]:
        """The moments' slices of the shard range `state` (8-bit scales: its blocks)."""
        if not self.plan.quantized_state:
            return {"exp_avg": state, "exp_avg_sq": state}
        block = self.plan.state_block
        blocks = slice(state.start // block, num_blocks(state.stop, block))
        return {"exp_avg": state, "exp_avg_sq": state, "exp_avg_scale": blocks, "exp_avg_sq_scale": blocks}

    def hyper(self, run: Run, param_groups: list[dict], adamw: bool, grad_scale) -> dict:
        """The kernel's hyper-parameters for one run: its group's, its step count's bias corrections."""
        group = param_groups[run.group]
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=self.steps[run.params[0]] + 1,
            adamw=adamw,
            grad_scale=grad_scale,
        )

    def quantized_range(self, state: slice) -> tuple[torch.Tensor, ...]:
        """8-bit state of the shard range `state` (which starts at a block boundary: [Note:
        quantized state]): exp_avg, exp_avg_sq (uint8) and their scales, views."""
        block = self.plan.state_block
        blocks = slice(state.start // block, num_blocks(state.stop, block))
        return self.exp_avg[state], self.exp_avg_sq[state], self.exp_avg_scale[blocks], self.exp_avg_sq_scale[blocks]

    def count_steps(self, used: list[bool]) -> None:
        """One more step for every used parameter (the update that counted it has run)."""
        for i, u in enumerate(used):
            if u:
                self.steps[i] += 1

    def runs(self, used: list[bool], group_of: list[int]) -> list[Run]:
        """This rank's owned pieces of used parameters, merged into as few ranges as the buffers
        allow ([Note: one kernel per range]), so one kernel call covers many tensors."""
        runs: list[Run | None] = []  # None: an unused parameter's piece, which ends a run
        for pc in self.pieces:  # in shard order: what lies between two pieces is padding
            if not used[pc.param]:
                runs.append(None)
                continue
            last = runs[-1] if runs else None
            if last is not None and self._joins(last, pc, group_of):
                gap = pc.state_offset - (last.state_lo + last.numel)
                runs[-1] = Run(
                    last.bucket,
                    last.bucket_lo,
                    last.state_lo,
                    last.numel + gap + pc.numel,
                    last.group,
                    last.params + (pc.param,),
                )
            else:
                runs.append(
                    Run(pc.bucket, pc.bucket_offset, pc.state_offset, pc.numel, group_of[pc.param], (pc.param,))
                )
        return [r for r in runs if r is not None]

    # [Note: one kernel per range]
    # The fused kernel is elementwise, so one call over a long range gives the same values as one
    # call per parameter: phase 3 launches one call per range of the shard that lives in one buffer
    # and shares a parameter group (its hyper-parameters) and a step count (its bias corrections).
    # Stage 3 keeps everything it updates in the rank's flat shard buffers (master or parameter
    # shard, gradient shard, moments), so its ranges run across units; stages 1 and 2 update the
    # owned range of each bucket's parameter buffer in place, so a range ends at a bucket's end.
    # Padding between two pieces (alignment, and the padding of each bucket to the world size:
    # [Note: padding]) joins the range: it is zero in every buffer and Adam keeps it zero (zero gradient,
    # zero moments, zero weight, so a zero update, decay included). An unused parameter's range is
    # never touched, so it ends a range.
    def _joins(self, last: Run, pc: Piece, group_of: list[int]) -> bool:
        if group_of[pc.param] != last.group or self.steps[pc.param] != self.steps[last.params[0]]:
            return False
        if self.plan.params_sharded and not self.plan.grads_as_bucket_views:
            return True  # everything indexed by the shard offset alone
        return pc.bucket == last.bucket and pc.bucket_offset - last.bucket_lo == pc.state_offset - last.state_lo

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
        if self.master_apart:
            return self.master[state], params
        return params, None

    # --- accessors ------------------------------------------------------------------------------

    def state_pieces(self, kind: str) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's part of `kind` as (parameter name, offset into the flattened parameter, fp32
        values) pieces, copied."""
        _check_kind("state_pieces", kind)
        if self.plan.quantized_state and kind != "master":
            return self._dequantized_pieces(kind)
        return [
            (self.names[pc.param], pc.param_offset, self.piece_view(pc, kind).detach().float().clone())
            for pc in self.pieces
        ]

    def quantized_pieces(self) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """8-bit state: this rank's pieces of exp_avg and exp_avg_sq as stored, copied: (parameter name,
        offset into the flattened parameter, {"exp_avg", "exp_avg_sq": uint8 indices; "exp_avg_scale",
        "exp_avg_sq_scale": their blocks' fp32 scales}), each at a block boundary of its parameter."""
        self._require_quantized("quantized_pieces")
        out = []
        for pc in self.pieces:
            state = slice(pc.state_offset, pc.state_offset + pc.numel)
            names = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
            values = {k: t.detach().clone() for k, t in zip(names, self.quantized_range(state))}
            out.append((self.names[pc.param], pc.param_offset, values))
        return out

    def _require_quantized(self, where: str) -> None:
        if not self.plan.quantized_state:
            raise ValueError(f"ShardState.{where}: the state is fp32 (MixedPrecisionPolicy(state_bits=32))")

    def piece_view(self, pc: Piece, kind: str) -> torch.Tensor:
        """The live 1-D values of `kind` for one of this rank's pieces: a view into the state (a
        checkpoint's save reads these views, its load writes them; after writing the master,
        sync_params_from_master()). With 8-bit state, "exp_avg" and "exp_avg_sq" are the uint8 code
        indices as stored, "exp_avg_scale" / "exp_avg_sq_scale" the fp32 scales of the piece's blocks
        ([Note: quantized state]); "momentum_buffer" and "momentum_buffer_scale" are exp_avg's
        ([Note: Muon's momentum in exp_avg's slot])."""
        if self.plan.quantized_state and kind in _SCALE_KINDS:
            scales = getattr(self, storage_of(kind))
            return scales[block_slice(pc.state_offset, pc.numel, self.plan.state_block)]
        _check_kind("piece_view", kind)
        state = slice(pc.state_offset, pc.state_offset + pc.numel)
        if kind == "master":
            return self.master_and_copy(pc.bucket, pc.bucket_offset, state)[0]
        return getattr(self, storage_of(kind))[state]

    def write_piece(self, pc: Piece, kind: str, values: torch.Tensor) -> None:
        """Write one of this rank's pieces of `kind` from its fp32 values (pc.numel of them): with
        8-bit state a moment is quantized as the kernel stores it (its blocks are the parameter's)."""
        with torch.no_grad():
            if self.plan.quantized_state and kind != "master":
                q, scales = quantize(values.float().reshape(-1), self.code(kind), self.plan.state_block)
                self.piece_view(pc, kind).copy_(q)
                self.piece_view(pc, scale_kind(kind)).copy_(scales)
            else:
                self.piece_view(pc, kind).copy_(values.reshape(-1))

    def load_pieces(self, kind: str, full: Mapping[int, torch.Tensor]) -> None:
        """Write this rank's pieces of `kind` from whole tensors by parameter index (any shape, the
        parameter's numel; 8-bit: quantized); parameters not in `full` keep their values."""
        _check_kind("load_pieces", kind)
        for pc in self.pieces:
            if pc.param in full:
                self.write_piece(pc, kind, full[pc.param].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel])

    def _dequantized_pieces(self, kind: str) -> list[tuple[str, int, torch.Tensor]]:
        """state_pieces of 8-bit state: the fp32 values it stands for."""
        return [(self.names[pc.param], pc.param_offset, self.dequantized(pc, kind)) for pc in self.pieces]

    def code(self, kind: str) -> torch.Tensor:
        """8-bit state: the code `kind` is stored in, on the state's device (exp_avg's and
        momentum_buffer's signed, exp_avg_sq's unsigned)."""
        code_of(kind)  # names the kind if it is none of them
        return self.codes[0 if storage_of(kind) == "exp_avg" else 1]

    def dequantized(self, pc: Piece, kind: str) -> torch.Tensor:
        """8-bit state: one of this rank's pieces of `kind` as the fp32 values its bytes and scales
        stand for (a new tensor)."""
        q, scales = self.piece_view(pc, kind), self.piece_view(pc, scale_kind(kind))
        return dequantize(q, scales, self.code(kind), self.plan.state_block)

    def sync_params_from_master(self) -> None:
        """After the fp32 master was written outside a step (a load): this rank's owned low-precision
        parameters become its rounding, as a step leaves them (fp32: nothing to do); 8-bit block tails
        are settled."""
        self._settle_block_tails()
        with torch.no_grad():
            for pc in self.pieces:
                state = slice(pc.state_offset, pc.state_offset + pc.numel)
                master, copy = self.master_and_copy(pc.bucket, pc.bucket_offset, state)
                if copy is None:
                    return
                copy.copy_(master)

    def follow_params(self) -> None:
        """Stages 1 and 2 with a master of its own: before the state is read whole (a checkpoint), the
        master takes every element the model holds that is no longer its rounding (written since the
        last step: [Note: the master follows the copy] in csrc/adam_math.h, which the step's kernel
        does for the ranges it updates). The delayed update's writes are taken when it is applied."""
        if not self.follows_params:
            return
        for pc in self.pieces:
            state = slice(pc.state_offset, pc.state_offset + pc.numel)
            follow(*self.master_and_copy(pc.bucket, pc.bucket_offset, state))

    def follow_shard(self, lo: int, numel: int) -> None:
        """Stage 3: this rank's parameter shard [lo, lo + numel) was written outside a step (a released
        parameter, or inside gathered_params()): the master follows it (follow()). In fp32 without
        offload the shard is the master."""
        if self.master_apart:
            follow(self.master[lo : lo + numel], self.param_shard[lo : lo + numel])
        self.let_go(lo, numel)  # in files: the written pages need not stay (an init of a model larger than memory)

    # [Note: block tails]
    # A parameter whose size is not a multiple of the block ends inside its last block; the rest of
    # that block is padding, which the kernel steps with the block (a zero gradient) and stores as
    # the code index of 0, so it dequantizes to 0 under any scale. A load writes the parameter's
    # elements and the block's scale but not the padding, which a fresh shard holds as index 0
    # (code value -0.99 in the signed code): times the loaded scale it would enter the next step as
    # a moment and change the block's scale. After a load the tails are set as a step leaves them.
    def _settle_block_tails(self) -> None:
        if not self.plan.quantized_state:
            return
        block = self.plan.state_block
        zero = [int(torch.searchsorted(thresholds(code.cpu()), torch.tensor(0.0))) for code in self.codes]
        with torch.no_grad():
            for pc in self.pieces:
                end = pc.state_offset + pc.numel
                tail = slice(end, pc.state_offset + num_blocks(pc.numel, block) * block)
                self.exp_avg[tail] = zero[0]
                self.exp_avg_sq[tail] = zero[1]

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
        return self.exp_avg.device

    def materialized_param_bytes(self) -> int:
        """Bytes of parameter storage that exist now: the parameter buffers' (stage 3: the units
        gathered now) plus stage 3's own shard."""
        in_files = self.files is not None  # counted by the files (report().offload)
        return sum(b.untyped_storage().nbytes() for b in self.param_buffers) + (
            0 if in_files else self.param_shard.numel() * self.param_shard.element_size()
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes held now, by kind (MemoryReport's fields); "grad_buckets": stage 1's gradient buckets,
        its full gradients, padding included."""

        def size(t):
            return t.numel() * t.element_size()

        def state_size(t):  # offloaded state is counted by the store (OffloadReport), not here
            return 0 if self.offloaded else size(t)

        return {
            "params": self.materialized_param_bytes(),
            "param_padding": sum(b.numel - self.layout.used_numel(b.index) for b in self.layout.buckets)
            * self.param_buffers[0].element_size(),
            "grad_shard": 0 if self.files is not None else size(self.grad_shard),
            "optimizer": state_size(self.exp_avg)
            + state_size(self.exp_avg_sq)
            + state_size(self.exp_avg_scale)
            + state_size(self.exp_avg_sq_scale),
            "master_copy": state_size(self.master),
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
# With 8-bit state (MixedPrecisionPolicy(state_bits=8)) the buffer is stored as exp_avg is: the signed
# dynamic code's bytes in the matrix's range of exp_avg and one fp32 scale per block in its blocks of
# exp_avg_scale (checkpoints name them "momentum_buffer" and "momentum_buffer_scale"); the matrix's
# range of exp_avg_sq and its scales stay unused (1 byte per element and 4 per block). The step:
# [Note: Muon's 8-bit momentum] in zerofast/optim/muon.py.
_STORAGE = {"momentum_buffer": "exp_avg", scale_kind("momentum_buffer"): scale_kind("exp_avg")}
_SCALE_KINDS = tuple(scale_kind(k) for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"))


def storage_of(kind: str) -> str:
    """The shard buffer that holds state `kind` ([Note: Muon's momentum in exp_avg's slot])."""
    return _STORAGE.get(kind, kind)


def follow(master: torch.Tensor, held: torch.Tensor) -> None:
    """The master takes each element the model holds (`held`, the parameter's range) that is no longer
    the master's rounding: [Note: the master follows the copy] in csrc/adam_math.h, for the callers
    outside the Adam kernel (a checkpoint's follow_params, Muon's matrices)."""
    with torch.no_grad():
        held = held.to(master.device)
        changed = held != master.to(held.dtype)
        if bool(changed.any()):
            master.copy_(torch.where(changed, held.to(master.dtype), master))


def _check_kind(where: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"ShardState.{where}: kind must be one of {', '.join(KINDS)}; got {kind!r}")
