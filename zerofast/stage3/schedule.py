"""Stage 3's schedule (Schedule): when each unit is gathered, waited for, kept and released, decided
from the module calls alone. Pure: no process group, no tensors; each event returns a list of Actions.
The runtime's hooks (runtime.py) carry them out; the estimator (zerofast/estimate/traffic.py) feeds it
a forward's expected calls and counts the gathers, so the estimate cannot drift from a step.

[Note: who gathers what]
A unit module gathers its unit while it runs. Any other module gathers only the units of the
parameters it holds itself (recurse=False), never units nested below it, which gather themselves
when they run (FSDP2's fully_shard works per module the same way). So `model.transformer`, holding
twelve blocks, gathers nothing of theirs, and a tied output head gathers the embedding's unit where
the head runs, wherever that unit is. The root holds the root unit for its whole forward and for
all of backward. A module whose units are already held by a module running around it (a Linear
inside a block) does nothing: no gather, no autograd hooks, so the cost is per unit, not per module.

[Note: stage 3 lifecycle]
Each unit's flat parameter buffer exists only while gathered (runtime.py's UnitBuffers). The events,
in the order a step meets them, and what the schedule decides at each:
  forward pre-hook of a module that must gather (enter, pre_forward): start gathering its units
    (unless prefetched), prefetch the units of the next call in the previous step's forward order,
    then wait for its own ([Note: gathers in flight together]);
  forward post-hook (exit_call, post_forward): release them (a unit is freed when no running
    module holds it any more); the runtime hooks the module's outputs, so that backward reaching
    them acquires the units again (pre_backward) and prefetches the units of the call before it in
    this step's forward; the root's units and the last call's are kept for backward instead
    ([Note: forward hands over to backward]);
  backward through the module's inputs (post_backward): release them again;
  end of backward (end_backward): release whatever is still gathered (the first module's inputs,
    token ids, need no gradient, so its post-backward never runs).
So at most two block units are gathered at once, the current one and the prefetched one, plus the
root unit. The forward order is that of the previous step; if a step runs modules in another order,
prefetching stops for the rest of that forward: a missed prefetch costs latency, never correctness,
since every module acquires what it needs itself. A unit whose next call is of the same unit
(another module of a merged unit, or the same module called again) is carried: kept gathered past
its release, and taken over by that call ([Note: merging small units] in units.py).

[Note: forward hands over to backward]
Backward starts with the modules forward ended with: the root (its output head) and the last
gathering call (the last block). Released at the end of forward, both would be gathered again at
once, the second with nothing to overlap it (no prefetch reaches the first call of backward). So
when backward follows (gradients enabled, an output that needs one), the root's units and those of
the last call of the previous step's forward are carried into backward instead, as a merged unit
is handed to its next module: the first acquire in backward takes them over. FSDP2 does
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

[Note: generation on stage 3]
Generation runs many forwards without a backward, and ranks run different numbers of them (their
prompts and stopping steps differ). Each forward gathers its units with collectives, so a rank
that runs one forward more than another would wait in a gather nobody joins. Two ways out:
  - the whole model gathered (opt.gathered_params(), pin()/unpin() here): entering the block
    gathers every unit (a collective, on every rank), and while a pin is open no unit is ever
    released, so every forward inside finds its units gathered and issues no collective: ranks may
    run any number of forwards, with or without gradients, KV cache or not. The calls are still
    recorded (the prefetch order stays that of the last forward). Leaving the block releases every
    unit that no running call holds, a local act; what was carried into backward is forgotten. A
    forward with gradients inside the block works: a backward inside the block finds its units
    gathered (its gradient reduces are collectives, as in any step: every rank runs it), a
    backward after the block gathers them again through its hooks, as after any forward
    (autograd's saved tensors are views of the unit buffers: [Note: stage 3 lifecycle]).
    Memory: the whole model in its dtype plus the shard, for the block's duration.
  - unit by unit (any forward outside the block): each forward gathers every unit once (the
    schedule above, two units in flight), so every rank must run the same number of forwards.
    Hugging Face's generate() does so with synced_gpus=True: a rank that has finished keeps
    running forwards (with a flag all_reduce per token) until every rank has. zerofast's Hugging
    Face integration, once imported (zerofast/integrations/hf_generation.py, a model host: [Note:
    stage-3 extension points] in extensions.py), turns it on for a stage-3 model outside the block,
    and off inside it, where the flag's all_reduce would be the only collective; synced_gpus=False
    outside the block raises GenerationSyncError on every rank at once. A generate() that no host
    serves raises at once outside the block, on every rank that calls it. A loop of one's own runs
    inside the block or runs the same number of forwards on every rank.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple


class UnitState(enum.Enum):
    SHARDED = "sharded"  # storage released; only this rank's shard exists
    GATHERING = "gathering"  # storage allocated, a gather collective in flight (a prefetch)
    GATHERED = "gathered"  # full parameters in place


class UnitOp(enum.Enum):
    """What the schedule asks of one unit's buffers."""

    GATHER = "gather"  # allocate the unit's buffer and start its gather collective
    WAIT = "wait"
    RELEASE = "release"  # free the unit's buffer: only this rank's shard remains


class Action(NamedTuple):
    op: UnitOp
    unit: int


# The state each action takes a unit from (a release follows the wait of a unit still in flight).
_STATE_BEFORE = {UnitOp.GATHER: UnitState.SHARDED, UnitOp.WAIT: UnitState.GATHERING, UnitOp.RELEASE: UnitState.GATHERED}


@dataclass(frozen=True)
class Call:
    """One forward call of a module that gathered."""

    module: Hashable  # the module (the schedule compares identities only)
    units: tuple[int, ...]  # the units it holds while it runs


class CallList(list):
    """The gathering calls of one forward, in order, and what each prefetches: the units of the first
    call after it (step +1, forward) or before it (step -1, backward) that needs others than it (the
    calls between share its units: a merged unit). One pass per direction: a scan per call was
    quadratic in a merged unit's calls (1,024 modules of one unit: 0.27 s of Python per step)."""

    def __init__(self):
        super().__init__()
        self._tables: dict[int, list[tuple[int, ...]]] = {}

    def append(self, call: Call) -> None:
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
        for i in order:
            j = i + step
            out[i] = self[j].units if self[j].units != self[i].units else out[j]
        return out


class CallRef(NamedTuple):
    """One gathering call, as its backward names it: the forward's calls stay those of that forward
    even after the next forward has begun."""

    calls: CallList  # the calls of the forward it belongs to, in order
    index: int  # its place among them

    @property
    def module(self) -> Hashable:
        return self.calls[self.index].module

    @property
    def units(self) -> tuple[int, ...]:
        return self.calls[self.index].units


class Schedule:
    """The lifecycle of every unit: [Note: stage 3 lifecycle]. Each event method updates the units'
    states and returns the actions that carry the update out, in order."""

    def __init__(self, root: Hashable, needs: Mapping[Hashable, tuple[int, ...]], num_units: int):
        self.root = root  # the module whose forward is a step's forward
        self.needs = needs  # module -> the units it holds while it runs ([Note: who gathers what])
        self.state = [UnitState.SHARDED] * num_units
        self.refs = [0] * num_units  # running calls (forward or backward) holding each unit
        self.carried = [False] * num_units  # kept gathered for the next call that acquires it
        self._into_backward: set[int] = set()  # this forward's units kept for backward
        self._calls = CallList()  # this forward's gathering calls, in order
        self._previous = CallList()  # the last complete forward's: the prefetch order
        self._running: list[CallRef | None] = []  # per running forward call (None: held around it)
        self._pins = 0  # open gathered_params() blocks: every unit stays gathered ([Note: generation on stage 3])

    # --- forward ------------------------------------------------------------------------------------

    def enter(self, module: Hashable) -> CallRef | None:
        """A forward call of `module` begins: the call it makes, or None if a module running around
        it holds its units ([Note: who gathers what]). The root's call begins a new forward."""
        units = self.needs[module]
        if module is self.root:
            if self._calls:  # the last forward, complete: the order to prefetch in
                self._previous = self._calls
            self._calls, self._running = CallList(), []
        elif self._held(units):
            self._running.append(None)
            return None
        call = CallRef(self._calls, len(self._calls))
        self._calls.append(Call(module, units))
        self._running.append(call)
        return call

    def pre_forward(self, call: CallRef) -> list[Action]:
        actions = self._release_unclaimed() if call.module is self.root else []
        actions += self._start(call.units, self._predicted_next(call))
        actions += self.acquire(call.units)
        return actions

    def exit_call(self) -> CallRef | None:
        """The innermost running forward call ends: the call enter() returned for it."""
        return self._running.pop() if self._running else None

    def post_forward(self, call: CallRef, backward_follows: bool) -> list[Action]:
        """`backward_follows`: gradients are enabled and an output needs one, so backward will reach
        this call ([Note: forward hands over to backward])."""
        prev, k = self._previous, call.index
        as_predicted = k < len(prev) and prev[k].module is call.module
        if backward_follows and (call.module is self.root or as_predicted and k + 1 == len(prev)):
            self._carry_into_backward(call.units)
        elif as_predicted and k + 1 < len(prev):
            self._carry(call.units, prev[k + 1])
        actions = self.release(call.units)
        if call.module is self.root:
            actions += self.release_all(self._into_backward)  # prefetches that no module claimed
            self._into_backward = set()
        return actions

    # --- backward -----------------------------------------------------------------------------------

    def pre_backward(self, call: CallRef) -> list[Action]:
        """Backward reaches the call's outputs."""
        return self._start(call.units, call.calls.next_other(call.index, -1)) + self.acquire(call.units)

    def post_backward(self, call: CallRef) -> list[Action]:
        """Backward has passed through the call's inputs."""
        if call.index > 0:
            self._carry(call.units, call.calls[call.index - 1])
        return self.release(call.units)

    def end_backward(self) -> list[Action]:
        return self.release_all()

    # --- unit operations ----------------------------------------------------------------------------

    def acquire(self, units: Iterable[int]) -> list[Action]:
        actions: list[Action] = []
        for u in units:
            self.refs[u] += 1
            self.carried[u] = False
            actions += self._ensure_gathered(u)
        return actions

    def release(self, units: Iterable[int]) -> list[Action]:
        actions: list[Action] = []
        for u in units:
            self.refs[u] = max(0, self.refs[u] - 1)
            if self.refs[u] == 0:
                actions += self._release_unit(u)
        return actions

    def release_all(self, keep: Iterable[int] = frozenset()) -> list[Action]:
        """Release every unit but `keep`'s, left to the next call that acquires them ([Note: forward
        hands over to backward])."""
        keep = set(keep)
        self.refs = [0] * len(self.refs)
        self.carried = [u in keep for u in range(len(self.refs))]
        return [a for u in range(len(self.state)) for a in self._release_unit(u)]

    def gather_all(self) -> list[Action]:
        return self.acquire(range(len(self.state)))

    def pin(self) -> list[Action]:
        """Gather every unit and keep it gathered, whatever the calls release, until unpin():
        [Note: generation on stage 3]. Pins nest."""
        self._pins += 1
        return [a for u in range(len(self.state)) for a in self._ensure_gathered(u)]

    def unpin(self) -> list[Action]:
        """Close the innermost pin; the last one releases every unit that no running call holds, and
        forgets what was carried (a backward still to come gathers what it needs itself)."""
        if self._pins == 0:
            raise RuntimeError("unpin() without a pin() open")
        self._pins -= 1
        if self._pins:
            return []
        actions: list[Action] = []
        for u in range(len(self.state)):
            if self.refs[u] == 0:
                self.carried[u] = False
                actions += self._release_unit(u)
        return actions

    @property
    def pinned(self) -> bool:
        return self._pins > 0

    def not_carried_out(self, actions: list[Action]) -> None:
        """The first of `actions` raised (a failed collective): their units go back to their states
        before them, so the states stay what the buffers hold. A failed wait is waited for again
        before its buffer is freed, never freed under a gather in flight."""
        for op, u in reversed(actions):
            self.state[u] = _STATE_BEFORE[op]

    def _predicted_next(self, call: CallRef) -> tuple[int, ...]:
        """The units of the previous forward's next other call, while this forward follows its order."""
        prev, k = self._previous, call.index
        if k + 1 < len(prev) and prev[k].module is call.module:
            return prev.next_other(k, +1)
        return ()

    def _start(self, own: tuple[int, ...], following: tuple[int, ...]) -> list[Action]:
        """[Note: gathers in flight together]: start gathering a call's own units, then prefetch
        `following`, before acquire() waits for the own ones."""
        return self._prefetch(own) + self._prefetch(following)

    def _prefetch(self, units: Iterable[int]) -> list[Action]:
        actions = []
        for u in units:
            if self.state[u] is UnitState.SHARDED:
                actions.append(Action(UnitOp.GATHER, u))
                self.state[u] = UnitState.GATHERING
        return actions

    def _ensure_gathered(self, u: int) -> list[Action]:
        actions = self._prefetch((u,))
        if self.state[u] is UnitState.GATHERING:
            actions.append(Action(UnitOp.WAIT, u))
            self.state[u] = UnitState.GATHERED
        return actions

    def _release_unit(self, u: int) -> list[Action]:
        if self._pins and self.state[u] is UnitState.GATHERED:
            return []  # gathered until the pin is closed: [Note: generation on stage 3]
        if self.carried[u] and self.state[u] is UnitState.GATHERED:
            return []  # the next call of a merged unit takes it over
        actions = []
        if self.state[u] is UnitState.GATHERING:  # a prefetch nobody used: finish it before freeing its buffer
            actions.append(Action(UnitOp.WAIT, u))
        if self.state[u] is not UnitState.SHARDED:
            actions.append(Action(UnitOp.RELEASE, u))
            self.state[u] = UnitState.SHARDED
        return actions

    def _release_unclaimed(self) -> list[Action]:
        """Release the units kept for a backward that never ran: [Note: forward hands over to backward]."""
        actions = []
        for u in range(len(self.state)):
            if self.carried[u] and self.refs[u] == 0:
                self.carried[u] = False
                actions += self._release_unit(u)
        return actions

    def _held(self, units: tuple[int, ...]) -> bool:
        return all(self.refs[u] > 0 and self.state[u] is UnitState.GATHERED for u in units)

    def _carry(self, units: tuple[int, ...], following: Call) -> None:
        """Keep the units `following` needs gathered past this release ([Note: merging small units]
        in units.py); if the call order changes, the next release_all (end of forward or backward)
        frees them."""
        for u in set(units) & set(following.units):
            self.carried[u] = True

    def _carry_into_backward(self, units: tuple[int, ...]) -> None:
        """Kept for backward, which starts with them: [Note: forward hands over to backward]."""
        for u in units:
            self.carried[u] = True
            self._into_backward.add(u)
