"""Stage 3 at run time (units are planned in units.py, their schedule decided in schedule.py):
  UnitBuffers  the unit buffers, whose storage exists only while gathered, and this rank's shards
  UnitTracker  the hooks: tell the schedule of every call, carry out its actions on the buffers
               ([Note: stage 3 lifecycle] in schedule.py)
Releasing a unit resizes its flat buffer's storage to 0 bytes; gathering resizes it back, copies in
this rank's shard and lets the gather collective bring the rest. The parameters, and the tensors
autograd saved in forward, are views of these buffers, so the re-gather before backward makes them
valid again without touching the graph.

[Note: stage 3 under torch.compile]
Users compile the whole model (torch.compile(model)) or each block (block.compile()). Dynamo
inlines module hooks into the graph it captures; ours resize storages and issue collectives through
the compiled module, which must happen at run time, in order, on every call, never be traced into a
graph. So each hook is torch.compiler.disable'd: Dynamo breaks the graph around it and runs it
eagerly, the compiled code between two hooks reads parameters whose storage the hook has just
gathered, and autograd's saved tensors share that storage as in eager mode. The cost is one graph
break per gathering module call (two per block under whole-model compile; counted in docs/design.md).
So a hooked module's call is never inlined: its own hooks run, whichever model the frame was compiled
for, and a frame compiled with our hooks in place is safe to reuse for another stage-3 model. The
opposite is not: see [Note: code compiled before stage 3].

[Note: code compiled before stage 3]
The crash (SIGSEGV in each rank's first compiled step, torch 2.14): compile and run a model of a
class (a DDP baseline, an eval copy), then wrap a fresh instance of the class with stage 3 and
compile it; or compile a model, run it, and then wrap it (cm = torch.compile(model); cm(x);
ZeroAdam(model, stage=3); cm(x)). Dynamo reuses a compiled frame whenever its guards pass, and
none of them sees what stage 3 changed:
  - no guard on any module's hook dicts: torch._dynamo.config.skip_nnmodule_hook_guards is True by
    default, for guard speed, documented as unsafe when hooks are added after compiling (pytorch
    #117758); with it False the sequences above train correctly;
  - modules are not guarded by identity: Dynamo inlines every module as an "unspecialized" one
    (inline_inbuilt_nn_modules, always on since torch 2.5), guarded by its type, its attributes and
    its parameters' dtype, shape and stride, so a frame compiled for another instance of the class
    passes for ours;
  - nothing about storage: ZeroAdam swaps each parameter's data for a view of its unit buffer
    (p.data = view), same shape and stride, and releasing a unit resizes the storage to 0 bytes,
    which no tensor guard checks.
So the frame compiled without our hooks (the root's forward: torch.compile(model) runs the root's
own hooks eagerly, around the frame) has the blocks' calls inlined with no hook: the graph takes
their parameters as inputs, never gathered, and Inductor's kernels read 0-byte storages. Stages 1
and 2 release nothing (but a frame compiled before ZeroAdam skips their overlap_param_gather
wait hooks the same way, seen as that option's in-flight-read error: ParamGather owns its
modules' classes too); stage 3 compiled alone traces with the hooks in place; blocks compiled
before wrapping (block.compile()) were spared only because a block's frame runs inside the block's
own hooks, which gather its whole unit.
The fix: UnitTracker moves every module it hooks to a subclass of the module's class (own_classes
in zerofast/_hook_classes.py: same name, module and qualified name, made once per class, as FSDP2's
fully_shard and torch.nn.utils.parametrize swap classes). Every compiled frame guards the type of
each module it inlined, or that it is the forward of, so a frame compiled before fails its guards
and Dynamo traces again, meeting the hooks; nothing else recompiles (torch._dynamo.reset() would
throw away every compiled function of the process, and flipping skip_nnmodule_hook_guards now would
not reach the frames already compiled). Frames compiled for a stage-3 model are shared by the next
stage-3 model of the class: correct by the note above. isinstance is unchanged; type(m) is the
subclass; remove() puts the original classes back. Tested by tests/test_compile.py
(test_stage3_after_code_compiled_without_it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..guard.params import ParamSlot, ParamState
from ..layout import Layout
from .extensions import attach_hosts, detach_hosts
from .schedule import Action, CallRef, Schedule, UnitOp, UnitState

# --- the unit buffers --------------------------------------------------------------------------------


@dataclass
class UnitPart:
    """The units' trainable or frozen storage ([Note: frozen parameters in stage 3]): flat buffers
    per bucket (the parameters are views of them), this rank's shard, their layout, the BucketComm
    that gathers them, and each unit's bucket (None: no parameter of this kind). `follow` (trainable
    only): the fp32 master follows a write of the shard's [offset, offset + numel) outside a step."""

    buffers: list[torch.Tensor]
    shard: torch.Tensor
    layout: Layout
    comm: object
    bucket_of: list[int | None]
    follow: Callable[[int, int], None] | None = None
    in_files: bool = False  # the shard is a file's mapping ([Note: parameters on disk]): not counted as memory
    empty: bool = False  # built on the meta device: the buffers hold nothing to shard out (the shard stays 0)
    # the shard in a file: read (offset, into) by explicit reads, a failure named ([Note: parameters on disk])
    read: Callable[[int, torch.Tensor], None] | None = None

    def read_from(self, read: Callable[[int, torch.Tensor], None]) -> None:
        """The shard is in a file, which `read` reads: each gather reads its range of it into the unit
        buffer, whose memory comes from the unit pool, kept across releases up to the three largest
        units' bytes (a forward holds the root's unit and two others at once: faulted in once, not at
        every gather: [Note: unit buffer pool] in csrc/unit_pool.cpp)."""
        from .. import _ops

        self.read = read
        limit = sum(sorted((b.numel() * b.element_size() for b in self.buffers), reverse=True)[:3])
        for b in self.buffers:
            if b.device.type == "cpu":
                _ops.pool_unit_storage(b, limit)


class UnitBuffers:
    """Stage 3's parameter memory: one flat buffer per unit (bucket), with storage only while the unit
    is gathered, and this rank's shard of every unit, which the optimizer updates. With unit_buckets
    None, unit u is bucket num_units - 1 - u ([Note: bucket order]). `frozen`: a second UnitPart,
    gathered and released with its unit ([Note: frozen parameters in stage 3]); unit_buckets then
    maps a unit to its trainable bucket (None: frozen only). A model sharded for inference only has
    a frozen part alone, given as the first ([Note: models sharded for inference only] in
    inference.py).

    Also the Shards of the parameters' slots (zerofast/guard/params.py, given by guard()): a slot's
    parameter is guarded while its unit is released, and a write to it reaches this rank's pieces
    of the shard ([Note: the model stays a torch model] in zerofast/guard/__init__.py)."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        shard: torch.Tensor,
        layout: Layout,
        rank: int,
        comm,
        unit_buckets: list[int | None] | None = None,
        frozen: UnitPart | None = None,
        follow: Callable[[int, int], None] | None = None,
        before_write: Callable[[], None] | None = None,
        let_go: Callable[[], None] | None = None,
        empty: bool = False,
    ):
        """follow: the trainable part's UnitPart.follow; before_write: raises if the shard may not be
        written now (the delayed update in flight); let_go: the shards are files' mappings, whose
        resident pages (the reduces' and the model's writes; a gather reads the file, not the mapping)
        this drops at each release ([Note: parameters on disk] in zerofast/offload/__init__.py); empty: the trainable buffers were never written ([Note:
        models built on the meta device] in zerofast/model_setup.py)."""
        self.buffers = buffers  # per bucket, 1D; the model's parameters are views of them
        self.shard = shard  # 1D, layout.shard_numel(rank): this rank's owned ranges
        self.layout, self.rank, self.comm = layout, rank, comm
        if unit_buckets is None:
            unit_buckets = [len(buffers) - 1 - u for u in range(len(buffers))]
        self.num_units = len(unit_buckets)
        self.parts = [
            UnitPart(buffers, shard, layout, comm, list(unit_buckets), follow, in_files=let_go is not None, empty=empty)
        ]
        self._let_go = let_go
        if frozen is not None:
            self.parts.append(frozen)
        self._offsets = [part.layout.shard_offsets(rank) for part in self.parts]
        self.world = layout.world  # the ranks the shards are spread over (guard.params.Shards)
        self._before_write = before_write
        # Per part, per bucket: the slots of its parameters (empty until guard()), and how many tensors
        # shared its storage when gathered_params() began (keep_writes: a view that escaped).
        self._slots: list[list[list[ParamSlot]]] = [[[] for _ in part.buffers] for part in self.parts]
        self._pieces: list[dict[int, list[tuple[int, int, int]]]] = [{} for _ in self.parts]
        self._uses_at_pin: list[list[int | None]] = [[None] * len(part.buffers) for part in self.parts]

    def guard(self, slots: list[list[ParamSlot]]) -> None:
        """Take the parameters' slots, per part (each slot's index: its parameter's in that part's
        layout), as their Shards: from now on a released unit's parameters are guarded."""
        for k, (part, part_slots) in enumerate(zip(self.parts, slots)):
            for slot in part_slots:
                slot.shards = self
                self._slots[k][part.layout.slots[slot.index].bucket].append(slot)
            for pc in part.layout.pieces(self.rank):
                self._pieces[k].setdefault(pc.param, []).append((pc.param_offset, pc.state_offset, pc.numel))
        for u in range(self.num_units):
            self._set_state(u, ParamState.WHOLE if self._gathered(u) else ParamState.SHARDED)

    def bucket(self, unit: int) -> int | None:
        """The trainable bucket of unit `unit` (None: it holds frozen parameters only)."""
        return self.parts[0].bucket_of[unit]

    def shard_out(self) -> None:
        """Copy this rank's owned ranges into the shard, then free every unit buffer."""
        for part, offsets in zip(self.parts, self._offsets):
            for b in range(len(part.buffers)) if not part.empty else ():
                lo, hi = part.layout.owned_range(b, self.rank)
                part.shard[offsets[b] : offsets[b] + hi - lo].copy_(part.buffers[b][lo:hi])
        for u in range(self.num_units):
            self.release(u)

    def gather_start(self, unit: int) -> None:
        for part, offsets in zip(self.parts, self._offsets):
            b = part.bucket_of[unit]
            if b is None:
                continue
            buf = part.buffers[b]
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            lo, hi = part.layout.owned_range(b, self.rank)
            if part.read is not None:
                part.read(offsets[b], buf[lo:hi])
            else:
                buf[lo:hi].copy_(part.shard[offsets[b] : offsets[b] + hi - lo])
            part.comm.gather_start(b, buf)

    def gather_wait(self, unit: int) -> None:
        for part in self.parts:
            if part.bucket_of[unit] is not None:
                part.comm.gather_wait(part.bucket_of[unit])
        self._set_state(unit, ParamState.WHOLE)

    def release(self, unit: int) -> None:
        for part in self.parts:
            if part.bucket_of[unit] is not None:
                part.buffers[part.bucket_of[unit]].untyped_storage().resize_(0)
        self._set_state(unit, ParamState.SHARDED)
        if self._let_go is not None:  # the pages the reduces and the model's writes made resident
            self._let_go()

    def _set_state(self, unit: int, state: ParamState) -> None:
        for k, part in enumerate(self.parts):
            b = part.bucket_of[unit]
            for slot in self._slots[k][b] if b is not None else ():
                slot.set_state(state)

    def _gathered(self, unit: int) -> bool:
        return any(
            part.buffers[part.bucket_of[unit]].untyped_storage().nbytes() > 0
            for part in self.parts
            if part.bucket_of[unit] is not None
        )

    # --- guard.params.Shards ------------------------------------------------------------------------

    def pieces(self, slot: ParamSlot) -> list[tuple[int, torch.Tensor]]:
        if self._before_write is not None:
            self._before_write()
        shard = self.parts[slot.part].shard
        return [(at, shard[lo : lo + n]) for at, lo, n in self._pieces[slot.part].get(slot.index, ())]

    def written(self, slot: ParamSlot, pieces) -> None:
        follow = self.parts[slot.part].follow
        for _, lo, n in self._pieces[slot.part].get(slot.index, ()) if follow is not None else ():
            follow(lo, n)

    def note_pinned(self) -> None:
        """gathered_params() has gathered every unit: count who shares each buffer's storage now (where
        every parameter has a slot to rebind: not tensor parallelism's stand-ins)."""
        if not all(
            self._slots[k][b] or not part.layout.buckets[b].params
            for k, part in enumerate(self.parts)
            for b in range(len(part.buffers))
        ):
            return
        for k, part in enumerate(self.parts):
            self._uses_at_pin[k] = [_storage_uses(b) if b.untyped_storage().nbytes() else None for b in part.buffers]

    def keep_writes(self, unit: int) -> None:
        """At the end of gathered_params(), before the release: what was written into the unit's
        owned ranges becomes the shard (the master follows); if more tensors share the buffer's
        storage than when the block began (a view taken inside, autograd's saved tensors), the buffer
        gets a new storage, so the release leaves the old one whole to them."""
        for k, (part, offsets) in enumerate(zip(self.parts, self._offsets)):
            b = part.bucket_of[unit]
            if b is None or part.buffers[b].untyped_storage().nbytes() == 0:
                continue
            lo, hi = part.layout.owned_range(b, self.rank)
            new, kept = part.buffers[b][lo:hi], part.shard[offsets[b] : offsets[b] + hi - lo]
            changed = new != kept
            if bool(changed.any()):
                kept.copy_(new)
                if part.follow is not None:
                    part.follow(offsets[b], hi - lo)
            at_pin = self._uses_at_pin[k][b]
            if at_pin is not None and _storage_uses(part.buffers[b]) > at_pin:
                self._own_storage(k, b)
            self._uses_at_pin[k][b] = None

    def _own_storage(self, k: int, b: int) -> None:
        """Bucket b of part k gets a new buffer (released), its parameters views of it; the old storage
        stays with whatever else holds it."""
        part = self.parts[k]
        new = torch.empty_like(part.buffers[b])  # allocated for the views to be made, then released
        with torch.no_grad():
            for slot in self._slots[k][b]:
                s = part.layout.slots[slot.index]
                slot.param.data = new.narrow(0, s.offset, s.numel).view(slot.param.shape)
        new.untyped_storage().resize_(0)
        part.buffers[b] = new

    def materialized_bytes(self, first: int = 0) -> int:
        """Bytes existing now (gathered buffers and shards) of the parts from `first` on (1: frozen)."""
        return sum(
            sum(b.untyped_storage().nbytes() for b in part.buffers)
            + (0 if part.in_files else part.shard.numel() * part.shard.element_size())
            for part in self.parts[first:]
        )


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors share t's storage (the storage object this call makes counted out)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1


# --- the hooks ---------------------------------------------------------------------------------------


class _PostBackward(torch.autograd.Function):
    """Identity in forward; in backward, tells the unit tracker that the module's backward is done."""

    @staticmethod
    def forward(ctx, done: Callable[[], None], *inputs):
        ctx.done = done
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


class UnitTracker:
    """Hooks the modules that gather, tells the schedule of each call and carries out its actions
    on the UnitBuffers: see [Note: stage 3 lifecycle] in schedule.py."""

    def __init__(self, model: nn.Module, needs: dict[nn.Module, tuple[int, ...]], buffers: UnitBuffers):
        self.model = model
        self.buffers = buffers
        self.schedule = Schedule(model, needs, buffers.num_units)
        self._callback_queued = False
        self.gathers = 0  # unit gathers started since built (a unit with frozen parameters too: one)
        self.handles = []
        # [Note: stage 3 under torch.compile]. Disabled on the bound methods, not by decorating them:
        # torch.compiler.disable imports Dynamo (1.6 s, 40% of `import zerofast`), which a process
        # making no optimizer (a launcher, the estimator) should not pay; a torch optimizer imports it.
        for name in ("_pre_forward", "_post_forward", "_pre_backward"):
            setattr(self, name, torch.compiler.disable(getattr(self, name)))
        for module in needs:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._original_classes = own_classes(needs)  # [Note: code compiled before stage 3]
        attach_hosts(model, self)  # [Note: stage-3 extension points] in zerofast/stage3/extensions.py

    @property
    def state(self) -> list[UnitState]:
        return self.schedule.state

    # --- unit operations, outside the hooks (gathered_params, full_state_dict, quiesce) ------------

    def acquire(self, units) -> None:
        self._carry_out(self.schedule.acquire(units))

    def release(self, units) -> None:
        self._carry_out(self.schedule.release(units))

    def release_all(self) -> None:
        self._carry_out(self.schedule.release_all())

    def gather_all(self) -> None:
        self._carry_out(self.schedule.gather_all())

    def pin(self) -> None:
        """Every unit gathered until unpin(): [Note: generation on stage 3] in schedule.py."""
        self._carry_out(self.schedule.pin())
        self.buffers.note_pinned()

    def unpin(self) -> None:
        """End the pin, keeping what was written inside (UnitBuffers.keep_writes)."""
        for unit, state in enumerate(self.schedule.state):
            if state is UnitState.GATHERED:
                self.buffers.keep_writes(unit)
        self._carry_out(self.schedule.unpin())

    @property
    def pinned(self) -> bool:
        return self.schedule.pinned

    @property
    def gather_world(self) -> int:
        """The ranks each unit gather runs across."""
        return dist.get_world_size(self.buffers.comm.gather_group)

    def _carry_out(self, actions: list[Action]) -> None:
        for i, (op, unit) in enumerate(actions):
            try:
                if op is UnitOp.RELEASE:
                    self.buffers.release(unit)
                    continue
                with torch.profiler.record_function("zerofast::unit_gather"):
                    if op is UnitOp.GATHER:
                        self.gathers += 1
                        self.buffers.gather_start(unit)
                    else:
                        self.buffers.gather_wait(unit)
            except BaseException:
                self.schedule.not_carried_out(actions[i:])
                raise

    # --- hooks (run eagerly: disabled in __init__) ----------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        if module is self.model and not self.schedule.pinned:  # pinned: no collective ([Note: generation on stage 3])
            self.buffers.comm.where.phase = "forward"
            self.buffers.comm.check_forward()
        call = self.schedule.enter(module)
        if call is None:  # a module running around this one holds its units: [Note: who gathers what]
            return None
        self._carry_out(self.schedule.pre_forward(call))
        if torch.is_grad_enabled():
            return self._wrap_inputs(call, args, kwargs)
        return None

    def _wrap_inputs(self, call: CallRef, args, kwargs):
        """The module's tensor arguments that need a gradient, through _PostBackward, so that their
        gradient (the module's backward done) releases its units."""
        plain = not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args)
        # Plain positional arguments (most modules) skip the pytree walk, a third of this hook's cost.
        flat, spec = (list(args), None) if plain else torch.utils._pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        done = functools.partial(self._post_backward, call)
        wrapped = _PostBackward.apply(done, *(flat[i] for i in positions))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return (tuple(flat), kwargs) if plain else torch.utils._pytree.tree_unflatten(flat, spec)

    def _post_forward(self, module, args, output):
        call = self.schedule.exit_call()
        if call is None:
            return
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        backward_follows = bool(outputs) and torch.is_grad_enabled()
        self._carry_out(self.schedule.post_forward(call, backward_follows))
        if backward_follows:
            if len(outputs) == 1:  # one output (most modules): a tensor hook, a fifth of the multi-grad hook's cost
                outputs[0].register_hook(_BeforeBackward(self, call))
            else:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads, call=call: self._pre_backward(call), mode="any"
                )

    def _pre_backward(self, call: CallRef) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.buffers.comm.where.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._carry_out(self.schedule.pre_backward(call))

    def _post_backward(self, call: CallRef) -> None:
        self._carry_out(self.schedule.post_backward(call))

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._carry_out(self.schedule.end_backward())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        restore_classes(self._original_classes)
        self._original_classes = {}
        detach_hosts(self)


class _BeforeBackward:
    """The gradient hook on a one-output module's output: its backward is about to run."""

    def __init__(self, tracker: UnitTracker, call: CallRef):
        self.tracker, self.call = tracker, call

    def __call__(self, grad: torch.Tensor) -> None:
        self.tracker._pre_backward(self.call)


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or lists, tuples and mappings of them (Hugging
    Face's ModelOutput is an OrderedDict)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in output_tensors(item)]
    if isinstance(output, Mapping):
        return [t for item in output.values() for t in output_tensors(item)]
    return []
