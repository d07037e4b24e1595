"""Stage 3 at run time: the hooks that gather a unit while it is used, and the unit buffers whose
storage exists only while gathered. Which parameters form a unit is planned in units.py.

[Note: who gathers what]
A unit module gathers its unit while it runs. Any other module gathers only the units of the
parameters it holds itself (recurse=False), never units nested below it, which gather themselves
when they run (FSDP2's fully_shard works per module the same way). So `model.transformer`, holding
twelve blocks, gathers nothing of theirs, and a tied output head gathers the embedding's unit where
the head runs, wherever that unit is. The root holds the root unit for its whole forward and for
all of backward. A module whose units are already held by a module running around it (a Linear
inside a block) does nothing: no gather, no autograd hooks, so the cost is per unit, not per module.

[Note: stage 3 lifecycle]
Each unit's flat parameter buffer exists only while gathered: releasing resizes its storage to 0
bytes, gathering resizes it back and fills it (each rank copies in its own shard, then the gather
collective brings the rest). The model's parameters are views into these buffers, and so are the
tensors autograd saved in forward: they share the storage, so the re-gather before backward makes
them valid again without touching the graph.
  forward pre-hook of a module that must gather: start gathering its units (unless prefetched),
    prefetch the units of the next call in the previous step's forward order, then wait for its
    own ([Note: gathers in flight together]);
  forward post-hook: release them (a unit is freed when no running module holds it any more), and
    hook the module's outputs, so that backward reaching them acquires the units again
    (pre-backward) and prefetches the units of the call before it in this step's forward; the
    root's units and the last call's are kept for backward instead ([Note: forward hands over to
    backward]);
  backward through the module's inputs (an identity autograd function wrapped around its tensor
    arguments, positional and keyword): release them again (post-backward);
  end of backward (a callback queued on the autograd engine): release whatever is still gathered
    (the first module's inputs, token ids, need no gradient, so its post-backward never runs).
So at most two block units are gathered at once, the current one and the prefetched one, plus the
root unit. A unit's state is an enum, and the code switches on it. The forward order is that of
the previous step; if a step runs modules in another order, prefetching stops for the rest of that
forward: a missed prefetch costs latency, never correctness, since every module acquires what it
needs itself.

[Note: forward hands over to backward]
Backward starts with the modules forward ended with: the root (its output head) and the last
gathering call (the last block). Both were released at the end of forward and gathered again at
once, with nothing to overlap the second gather (no prefetch reaches the first call of backward).
So when backward follows (gradients enabled, an output that needs one), the root's units and
those of the last call of the previous step's forward are carried into backward instead, like a
merged unit handed to its next module: the first acquire in backward takes them over. FSDP2 does
the same for its root (reshard_after_forward=False). Peak memory is unchanged: between forward and
backward they are the root and one block, and backward's first block acquires itself and
prefetches the next anyway. A forward with gradients and no backward after it leaves them to the
next forward's start (_release_unclaimed); one in another order than the previous step's keeps at
most the unit predicted last until the end of backward. On bench_step's GPT (2 gloo ranks) this
saves 2 of 18 gathers per step and the ~4 ms wait before the last block's backward; with [Note:
gathers in flight together] the stage-3 step went from 280-289 to 276-282 ms (medians of three
interleaved A/B runs against DDP's 239-250 ms on a shared 2-core machine: 2-3%).

[Note: gathers in flight together]
A call whose units were not prefetched (the root's at the start of forward, any call after the
order changed) starts its own gather, then the prefetch of the next call, and only then waits
for its own: the two collectives are in flight together, and the root's small unit no longer
delays the first block's gather. Which units are gathered when is unchanged; only the wait moves.

[Note: stage 3 under torch.compile]
Users compile the whole model (torch.compile(model)) or each block (block.compile()). Dynamo
inlines module hooks into the graph it captures; ours resize storages and issue collectives through
the compiled module, which must happen at run time, in order, on every call, never be traced into a
graph. So each hook is torch.compiler.disable'd: Dynamo breaks the graph around it and runs it
eagerly, the compiled code between two hooks reads parameters whose storage the hook has just
gathered, and autograd's saved tensors share that storage as in eager mode. The cost is one graph
break per gathering module call (two per block under whole-model compile; counted in docs/design.md).
A hooked module's call is therefore never inlined into a graph: Dynamo breaks the graph at it and
calls the module eagerly, so its own hooks run, whichever model the frame was compiled for; a frame
compiled with our hooks in place is safe to reuse for another stage-3 model. The opposite is not:
see [Note: code compiled before stage 3].

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
in zerofast/_hook_classes.py:
same name, module and qualified name, made once per class, as FSDP2's fully_shard and
torch.nn.utils.parametrize swap classes). Every compiled frame guards the type of each module it
inlined, or that it is the forward of, so a frame compiled before fails its guards and Dynamo
traces again, meeting the hooks; nothing else recompiles (torch._dynamo.reset() would throw away
every compiled function of the process, and flipping skip_nnmodule_hook_guards now would not
reach the frames already compiled). Frames compiled for a stage-3 model are shared by the next
stage-3 model of the class: correct by the note above. isinstance is unchanged; type(m) is the
subclass; remove() puts the original classes back. Tested by tests/test_compile.py
(test_stage3_after_code_compiled_without_it).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..layout import Layout


class UnitState(enum.Enum):
    SHARDED = "sharded"  # storage released; only this rank's shard exists
    GATHERING = "gathering"  # storage allocated, a gather collective in flight (a prefetch)
    GATHERED = "gathered"  # full parameters in place


# --- the unit buffers --------------------------------------------------------------------------------


@dataclass
class UnitPart:
    """One kind of parameter storage of the units (trainable or frozen: [Note: frozen parameters in
    stage 3]): its flat buffers (one per bucket; the model's parameters are views of them), this
    rank's shard, the layout addressing both, the BucketComm that gathers its buckets, and which
    bucket holds each unit's part (None: the unit has no parameter of this kind)."""

    buffers: list[torch.Tensor]
    shard: torch.Tensor
    layout: Layout
    comm: object
    bucket_of: list[int | None]


class UnitBuffers:
    """Stage 3's parameter memory: one flat buffer per unit (bucket), whose storage exists only while
    the unit is gathered, and this rank's shard of every unit, which the optimizer updates. With
    unit_buckets None, unit u is bucket num_units - 1 - u: buckets follow backward order ([Note:
    bucket order]). `frozen`: a second UnitPart for the frozen parameters, gathered and released
    with their unit ([Note: frozen parameters in stage 3]); then unit_buckets maps each unit to its
    trainable bucket (None: the unit is frozen only)."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        shard: torch.Tensor,
        layout: Layout,
        rank: int,
        comm,
        unit_buckets: list[int | None] | None = None,
        frozen: UnitPart | None = None,
    ):
        self.buffers = buffers  # per bucket, 1D; the model's parameters are views of them
        self.shard = shard  # 1D, layout.shard_numel(rank): this rank's owned ranges
        self.layout, self.rank, self.comm = layout, rank, comm
        if unit_buckets is None:
            unit_buckets = [len(buffers) - 1 - u for u in range(len(buffers))]
        self.num_units = len(unit_buckets)
        self.parts = [UnitPart(buffers, shard, layout, comm, list(unit_buckets))]
        if frozen is not None:
            self.parts.append(frozen)
        self._offsets = [part.layout.shard_offsets(rank) for part in self.parts]

    def bucket(self, unit: int) -> int | None:
        """The trainable bucket of unit `unit` (None: it holds frozen parameters only)."""
        return self.parts[0].bucket_of[unit]

    def shard_out(self) -> None:
        """Copy this rank's owned ranges into the shard, then free every unit buffer."""
        for part, offsets in zip(self.parts, self._offsets):
            for b in range(len(part.buffers)):
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
            buf[lo:hi].copy_(part.shard[offsets[b] : offsets[b] + hi - lo])
            part.comm.gather_start(b, buf)

    def gather_wait(self, unit: int) -> None:
        for part in self.parts:
            if part.bucket_of[unit] is not None:
                part.comm.gather_wait(part.bucket_of[unit])

    def release(self, unit: int) -> None:
        for part in self.parts:
            if part.bucket_of[unit] is not None:
                part.buffers[part.bucket_of[unit]].untyped_storage().resize_(0)

    def materialized_bytes(self, first: int = 0) -> int:
        """Bytes of the parts from `first` on (1: the frozen part) that exist now: their gathered
        buffers and their shards."""
        return sum(
            sum(b.untyped_storage().nbytes() for b in part.buffers) + part.shard.numel() * part.shard.element_size()
            for part in self.parts[first:]
        )


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


@dataclass
class _Call:
    """One forward call of a module that gathered (see [Note: stage 3 lifecycle])."""

    module: nn.Module
    units: tuple[int, ...]


class UnitTracker:
    """Drives the lifecycle of every unit over its UnitBuffers: see [Note: stage 3 lifecycle]."""

    def __init__(self, model: nn.Module, needs: dict[nn.Module, tuple[int, ...]], buffers: UnitBuffers):
        self.model = model
        self.needs = needs  # module -> units it holds while it runs
        self.buffers = buffers
        n = buffers.num_units
        self.state = [UnitState.SHARDED] * n
        self.refs = [0] * n  # running modules (forward or backward) holding each unit
        self.carried = [False] * n  # kept gathered for the next call: [Note: merging small units]
        self._into_backward: set[int] = (
            set()
        )  # this forward's units kept for backward: [Note: forward hands over to backward]
        self._calls = _CallList()  # this step's gathering calls, in forward order
        self._previous = _CallList()  # the last complete forward's: the prefetch order
        self._running: list[int | None] = []  # per running forward call: its index in _calls (None: skipped)
        self._callback_queued = False
        self.handles = []
        for module in needs:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._original_classes = own_classes(needs)  # [Note: code compiled before stage 3]

    # --- unit operations ------------------------------------------------------------------------

    def acquire(self, units) -> None:
        for u in units:
            self.refs[u] += 1
            self.carried[u] = False
            self._ensure_gathered(u)

    def release(self, units) -> None:
        for u in units:
            self.refs[u] = max(0, self.refs[u] - 1)
            if self.refs[u] == 0:
                self._release_unit(u)

    def prefetch(self, units) -> None:
        for u in units:
            if self.state[u] is UnitState.SHARDED:
                with torch.profiler.record_function("zerofast::unit_gather"):
                    self.buffers.gather_start(u)
                self.state[u] = UnitState.GATHERING

    def _start(self, own, following) -> None:
        """[Note: gathers in flight together]: start gathering a call's own units, then prefetch
        `following`, before acquire() waits for the own ones."""
        self.prefetch(own)
        self.prefetch(following)

    def _ensure_gathered(self, u: int) -> None:
        if self.state[u] is UnitState.SHARDED:
            with torch.profiler.record_function("zerofast::unit_gather"):
                self.buffers.gather_start(u)
            self.state[u] = UnitState.GATHERING
        if self.state[u] is UnitState.GATHERING:
            with torch.profiler.record_function("zerofast::unit_gather"):
                self.buffers.gather_wait(u)
            self.state[u] = UnitState.GATHERED

    def _release_unit(self, u: int) -> None:
        if self.carried[u] and self.state[u] is UnitState.GATHERED:
            return  # the next call of a merged unit takes it over
        if self.state[u] is UnitState.GATHERING:
            self.buffers.gather_wait(u)  # a prefetch nobody used: finish it before freeing its buffer
        if self.state[u] is not UnitState.SHARDED:
            self.buffers.release(u)
            self.state[u] = UnitState.SHARDED

    def release_all(self, keep=frozenset()) -> None:
        """Release every unit but those in `keep`, which stay gathered for the next call that
        acquires them ([Note: forward hands over to backward])."""
        self.refs = [0] * len(self.refs)
        self.carried = [u in keep for u in range(len(self.refs))]
        for u in range(len(self.state)):
            self._release_unit(u)

    def _release_unclaimed(self) -> None:
        """Release the units kept for a backward that never ran (a forward with gradients enabled
        and no backward after it): [Note: forward hands over to backward]."""
        for u in range(len(self.state)):
            if self.carried[u] and self.refs[u] == 0:
                self.carried[u] = False
                self._release_unit(u)

    def gather_all(self) -> None:
        self.acquire(range(len(self.state)))

    def _held(self, units: tuple[int, ...]) -> bool:
        return all(self.refs[u] > 0 and self.state[u] is UnitState.GATHERED for u in units)

    # --- hooks ----------------------------------------------------------------------------------
    # See [Note: stage 3 under torch.compile]: the hooks always run eagerly.

    @torch.compiler.disable
    def _pre_forward(self, module, args, kwargs):
        units = self.needs[module]
        if module is self.model:
            self.buffers.comm.where.phase = "forward"
            self.buffers.comm.check_forward()
            if self._calls:  # the last forward, complete: the order to prefetch in
                self._previous = self._calls
            self._calls, self._running = _CallList(), []
            self._release_unclaimed()
        elif self._held(units):  # a module running around this one holds them: [Note: who gathers what]
            self._running.append(None)
            return None
        k = len(self._calls)
        self._running.append(k)
        self._calls.append(_Call(module, units))
        prev = self._previous
        self._start(units, prev.next_other(k, +1) if k + 1 < len(prev) and prev[k].module is module else ())
        self.acquire(units)
        if torch.is_grad_enabled():
            return self._wrap_inputs(k, args, kwargs)
        return None

    def _wrap_inputs(self, k: int, args, kwargs):
        """The module's tensor arguments that need a gradient, through _PostBackward, so that their
        gradient (the module's backward done) releases its units."""
        plain = not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args)
        # Plain positional arguments (most modules) skip the pytree walk, a third of this hook's cost.
        flat, spec = (list(args), None) if plain else torch.utils._pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        done = functools.partial(self._post_backward, self._calls, k)
        wrapped = _PostBackward.apply(done, *(flat[i] for i in positions))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return (tuple(flat), kwargs) if plain else torch.utils._pytree.tree_unflatten(flat, spec)

    @torch.compiler.disable
    def _post_forward(self, module, args, output):
        k = self._running.pop() if self._running else None
        if k is None:
            return
        units = self.needs[module]
        prev = self._previous
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        backward_follows = bool(outputs) and torch.is_grad_enabled()
        if backward_follows and (module is self.model or k + 1 == len(prev) and prev[k].module is module):
            self._carry_into_backward(units)
        elif k + 1 < len(prev) and prev[k].module is module:
            self._carry(units, module, prev[k + 1])
        self.release(units)
        if module is self.model:
            self.release_all(self._into_backward)  # prefetches that no module claimed
            self._into_backward = set()
        if backward_follows:
            if len(outputs) == 1:  # one output (most modules): a tensor hook, a fifth of the multi-grad hook's cost
                outputs[0].register_hook(_BeforeBackward(self, self._calls, k))
            else:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads, calls=self._calls, k=k: self._pre_backward(calls, k), mode="any"
                )

    @torch.compiler.disable
    def _pre_backward(self, calls: list[_Call], k: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.buffers.comm.where.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._start(calls[k].units, calls.next_other(k, -1))
        self.acquire(calls[k].units)

    def _post_backward(self, calls: list[_Call], k: int) -> None:
        if k > 0:
            self._carry(calls[k].units, calls[k].module, calls[k - 1])
        self.release(calls[k].units)

    def _carry(self, units: tuple[int, ...], module: nn.Module, following: _Call) -> None:
        """Keep the units that the following call needs (another module of a merged unit, or the
        same module called again) gathered past this release: [Note: merging small units]. It
        acquires them at once; a call order that changes leaves them to the next release_all
        (the end of forward or of backward)."""
        for u in set(units) & set(following.units):
            self.carried[u] = True

    def _carry_into_backward(self, units: tuple[int, ...]) -> None:
        """Keep the units of the root and of the last call in forward gathered for backward, which
        starts with them: [Note: forward hands over to backward]."""
        for u in units:
            self.carried[u] = True
            self._into_backward.add(u)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.release_all()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        restore_classes(self._original_classes)
        self._original_classes = {}


class _BeforeBackward:
    """The gradient hook on a one-output module's output: its backward is about to run."""

    def __init__(self, tracker: UnitTracker, calls: _CallList, k: int):
        self.tracker, self.calls, self.k = tracker, calls, k

    def __call__(self, grad: torch.Tensor) -> None:
        self.tracker._pre_backward(self.calls, self.k)


class _CallList(list):
    """The gathering calls of one forward, in order, and for each call what to prefetch: the units of
    the first call after it (step +1, forward) or before it (step -1, backward) that needs others
    than it (the calls in between share its units: a merged unit). Computed once per direction, in
    one pass: a scan per call was quadratic in the calls of a merged unit (1,024 modules of one
    unit: 0.27 s of Python per step)."""

    def __init__(self):
        super().__init__()
        self._tables: dict[int, list[tuple[int, ...]]] = {}

    def append(self, call: _Call) -> None:
        self._tables = {}
        super().append(call)

    def next_other(self, k: int, step: int) -> tuple[int, ...]:
        table = self._tables.get(step)
        if table is None:
            table = self._tables[step] = self._table(step)
        return table[k]

    def _table(self, step: int) -> list[tuple[int, ...]]:
        n = len(self)
        out: list[tuple[int, ...]] = [()] * n
        order = range(n - 2, -1, -1) if step > 0 else range(1, n)
        for i in order:  # from the far end towards the start of the walk
            j = i + step
            out[i] = self[j].units if self[j].units != self[i].units else out[j]
        return out


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
