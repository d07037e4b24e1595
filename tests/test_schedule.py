"""Stage 3's schedule (zerofast/stage3/schedule.py) alone: no process group, no tensors. The modules
are names; each test drives the schedule as the runtime's hooks do and reads its decisions as data.
Every action is checked against the state it needs (a gather only of a released unit, a wait only of
one in flight, a release only of one that exists), and every call against its units being gathered
while it runs. Runs in well under a second."""

import random

import pytest

from zerofast.stage3.schedule import Call, CallList, Schedule, UnitOp


class Buffers:
    """The unit buffers as the actions leave them."""

    def __init__(self, num_units: int):
        self.state = ["released"] * num_units

    def apply(self, actions) -> list[str]:
        """Carry the actions out; return them as "G1" (gather unit 1), "W1" (wait), "R1" (release)."""
        needs = {UnitOp.GATHER: "released", UnitOp.WAIT: "in flight", UnitOp.RELEASE: None}
        after = {UnitOp.GATHER: "in flight", UnitOp.WAIT: "gathered", UnitOp.RELEASE: "released"}
        for op, u in actions:
            if needs[op] is None:
                assert self.state[u] != "released", f"{op.name} of unit {u}, which is not gathered"
            else:
                assert self.state[u] == needs[op], f"{op.name} of unit {u}, which is {self.state[u]}"
            self.state[u] = after[op]
        return [f"{op.name[0]}{u}" for op, u in actions]

    def assert_gathered(self, units, who) -> None:
        missing = [u for u in units if self.state[u] != "gathered"]
        assert not missing, f"{who} runs with units {missing} not gathered"


def run_step(schedule: Schedule, tree, buffers: Buffers, backward: bool = True, grad: bool = True):
    """One forward of `tree` ((module, [children]), nested as the calls nest; a module may appear
    more than once) with gradients enabled or not, then its backward (the calls in reverse: a call's
    outputs, then its inputs; the root's inputs need no gradient), as the runtime's hooks drive the
    schedule. Returns the actions of the forward and of the backward, and the modules that made a
    call (the others ran inside a module holding their units)."""
    forward: list[str] = []
    hooked = []  # (begins, call) of each call the schedule keeps, in forward order

    def run(node) -> None:
        module, children = node
        call = schedule.enter(module)
        if call is not None:
            forward.extend(buffers.apply(schedule.pre_forward(call)))
            hooked.append((True, call))
        buffers.assert_gathered(schedule.needs[module], f"{module}'s forward")
        for child in children:
            run(child)
        assert schedule.exit_call() is call
        if call is not None:
            forward.extend(buffers.apply(schedule.post_forward(call, backward_follows=grad)))
            hooked.append((False, call))

    run(tree)
    callers = [call.module for begins, call in hooked if begins]
    if not (backward and grad):
        return forward, [], callers
    back: list[str] = []
    for begins, call in reversed(hooked):
        if not begins:
            back += buffers.apply(schedule.pre_backward(call))
            buffers.assert_gathered(call.units, f"{call.module}'s backward")
        elif call.module is not schedule.root:
            back += buffers.apply(schedule.post_backward(call))
    back += buffers.apply(schedule.end_backward())
    assert buffers.state == ["released"] * len(buffers.state), "units left gathered after backward"
    return forward, back, callers


def schedule_for(needs):
    n = 1 + max(u for units in needs.values() for u in units)
    return Schedule(next(iter(needs)), needs, n), Buffers(n)


# A GPT-like model: the root's unit 0 (embedding, final norm) with a tied head that runs inside the
# root's forward; two blocks, units 1 and 2, each with a submodule of its own unit inside.
NESTED = {"model": (0,), "b0": (1,), "b0.attn": (1,), "b1": (2,), "b1.attn": (2,), "head": (0,)}
NESTED_TREE = ("model", [("b0", [("b0.attn", [])]), ("b1", [("b1.attn", [])]), ("head", [])])


def test_nested_units_and_the_carry_into_backward():
    schedule, buffers = schedule_for(NESTED)
    # First step: no previous order, so forward prefetches nothing and keeps only the root's unit for backward.
    fwd, bwd, callers = run_step(schedule, NESTED_TREE, buffers)
    assert fwd == ["G0", "W0", "G1", "W1", "R1", "G2", "W2", "R2"]
    assert bwd == ["G2", "G1", "W2", "R2", "W1", "R1", "R0"]
    # The submodules and the tied head (units held by a module running around them) make no call.
    assert callers == ["model", "b0", "b1"]
    # From the second step on: each call prefetches the next one's units while its own gather is in
    # flight, and the last block's unit (2) stays gathered from forward into backward with the root's.
    for _ in range(2):
        fwd, bwd, callers = run_step(schedule, NESTED_TREE, buffers)
        assert fwd == ["G0", "G1", "W0", "G2", "W1", "R1", "W2"]
        assert bwd == ["G1", "R2", "W1", "R1", "R0"]
        assert callers == ["model", "b0", "b1"]


def test_a_module_called_twice_in_a_row_is_gathered_once():
    needs = {"model": (0,), "shared": (1,), "b": (2,)}
    tree = ("model", [("shared", []), ("shared", []), ("b", [])])
    schedule, buffers = schedule_for(needs)
    run_step(schedule, tree, buffers)
    fwd, bwd, _ = run_step(schedule, tree, buffers)
    # The first call carries unit 1 to the second (no release, no gather between them); the prefetch
    # of the first reaches past the second, to b's unit.
    assert fwd == ["G0", "G1", "W0", "G2", "W1", "R1", "W2"]
    # Backward hands unit 1 from the second call to the first the same way.
    assert bwd == ["G1", "R2", "W1", "R1", "R0"]


def test_a_module_called_twice_apart_is_gathered_twice():
    needs = {"model": (0,), "shared": (1,), "b": (2,)}
    tree = ("model", [("shared", []), ("b", []), ("shared", [])])
    schedule, buffers = schedule_for(needs)
    run_step(schedule, tree, buffers)
    fwd, bwd, _ = run_step(schedule, tree, buffers)
    assert fwd == ["G0", "G1", "W0", "G2", "W1", "R1", "G1", "W2", "R2", "W1"]
    assert bwd == ["G2", "R1", "G1", "W2", "R2", "W1", "R1", "R0"]


def test_merged_unit_is_handed_from_module_to_module():
    needs = {"model": (0,), "b0": (1,), "b1": (1,), "b2": (2,)}  # b0 and b1: one merged unit
    tree = ("model", [("b0", []), ("b1", []), ("b2", [])])
    schedule, buffers = schedule_for(needs)
    fwd, *_ = run_step(schedule, tree, buffers)
    assert fwd.count("G1") == 2  # first step: no order to go by, each module gathers it
    fwd, bwd, _ = run_step(schedule, tree, buffers)
    assert fwd.count("G1") == 1 and bwd.count("G1") == 1


def test_a_forward_without_backward_leaves_the_kept_units_to_the_next_forward():
    schedule, buffers = schedule_for(NESTED)
    run_step(schedule, NESTED_TREE, buffers)
    run_step(schedule, NESTED_TREE, buffers, backward=False)
    assert buffers.state == ["gathered", "released", "gathered"]  # kept for a backward that never came
    fwd, bwd, _ = run_step(schedule, NESTED_TREE, buffers)
    assert fwd[:2] == ["R0", "R2"]  # released at the next forward's start, then gathered as usual
    assert fwd[2:] == ["G0", "G1", "W0", "G2", "W1", "R1", "W2"]
    assert bwd == ["G1", "R2", "W1", "R1", "R0"]


def test_a_forward_without_gradients_keeps_nothing():
    schedule, buffers = schedule_for(NESTED)
    run_step(schedule, NESTED_TREE, buffers)
    fwd, *_ = run_step(schedule, NESTED_TREE, buffers, grad=False)
    assert fwd == ["G0", "G1", "W0", "G2", "W1", "R1", "W2", "R2", "R0"]
    assert buffers.state == ["released"] * 3


def test_a_changed_order_stops_prefetching_but_gathers_what_each_call_needs():
    schedule, buffers = schedule_for(NESTED)
    run_step(schedule, NESTED_TREE, buffers)
    swapped = ("model", [("b1", []), ("b0", [])])
    fwd, bwd, _ = run_step(schedule, swapped, buffers)
    # The root prefetched b0's unit, as predicted; b1 came first instead: from there on nothing is prefetched.
    assert fwd == ["G0", "G1", "W0", "G2", "W2", "R2", "W1", "R1"]
    assert bwd == ["G1", "G2", "W1", "R1", "W2", "R2", "R0"]


def test_actions_that_were_not_carried_out_leave_their_units_as_they_were():
    """A gather that failed (another rank died) is waited for again before its buffer is freed: the
    states go back to what the buffers hold."""
    schedule, buffers = schedule_for(NESTED)
    run_step(schedule, NESTED_TREE, buffers)
    root = schedule.enter("model")
    actions = schedule.pre_forward(root)
    assert buffers.apply(actions[:2]) == ["G0", "G1"]  # the wait for unit 0 (actions[2]) raises
    schedule.not_carried_out(actions[2:])
    assert schedule.exit_call() is root
    # The root's post-forward still runs (always_call): unit 0 is waited for again, then released.
    assert buffers.apply(schedule.post_forward(root, backward_follows=False)) == ["W0", "R0", "W1", "R1"]


def test_random_call_trees_keep_every_action_legal():
    """Random nestings, modules called more than once, merged units and forwards without backward:
    every action applies to a unit in the state it needs, every call runs gathered, and nothing
    stays gathered after a backward (both checked inside run_step)."""
    rng = random.Random(0)
    for _ in range(100):
        units = rng.randint(1, 5)
        modules = [f"m{i}" for i in range(rng.randint(1, 6))]
        needs = {"root": (0,)} | {
            m: tuple(sorted(rng.sample(range(units), rng.randint(1, min(2, units))))) for m in modules
        }
        schedule, buffers = Schedule("root", needs, units), Buffers(units)

        def tree(depth):
            return [(rng.choice(modules), tree(depth + 1)) for _ in range(rng.randint(0, 3 if depth < 2 else 0))]

        shapes = [("root", tree(0)) for _ in range(2)]
        for _ in range(4):
            run_step(schedule, rng.choice(shapes), buffers, backward=rng.random() < 0.8, grad=rng.random() < 0.9)


def test_prefetch_targets_match_the_plain_definition():
    """CallList.next_other, computed once per direction, against its definition: the units of the
    first call after (+1) or before (-1) call k whose units differ from call k's; () if none."""

    def plain(calls, k, step):
        i = k + step
        while 0 <= i < len(calls):
            if calls[i].units != calls[k].units:
                return calls[i].units
            i += step
        return ()

    rng = random.Random(0)
    for n in (0, 1, 2, 5, 40):
        for _ in range(20):
            calls = CallList()
            for _ in range(n):  # runs of equal units, as merged units give
                calls.append(Call(None, rng.choice([(0,), (1,), (2,), (1, 2), ()])))
            for step in (1, -1):
                assert [calls.next_other(k, step) for k in range(n)] == [plain(calls, k, step) for k in range(n)]
            if n:  # appending invalidates the tables
                calls.append(Call(None, (7,)))
                assert calls.next_other(n - 1, 1) == ((7,) if calls[n - 1].units != (7,) else ())


def test_pinned_units_stay_gathered_through_any_forwards_and_are_released_on_unpin():
    """[Note: generation on stage 3]: pin() gathers every unit once; forwards (with or without
    gradients, any number) then issue no action at all; nested pins hold until the outer unpin(),
    which releases every unit; the next step runs as usual."""
    schedule, buffers = schedule_for(NESTED)
    run_step(schedule, NESTED_TREE, buffers)  # a training step first: an order to prefetch in
    assert buffers.apply(schedule.pin()) == ["G0", "W0", "G1", "W1", "G2", "W2"]
    for grad in (False, False, True, False):
        fwd, _, callers = run_step(schedule, NESTED_TREE, buffers, backward=False, grad=grad)
        assert fwd == [] and callers == ["model", "b0", "b1"]
    assert buffers.apply(schedule.pin()) == []  # nested
    assert buffers.apply(schedule.unpin()) == []
    assert schedule.pinned
    assert sorted(buffers.apply(schedule.unpin())) == ["R0", "R1", "R2"]
    assert not schedule.pinned and buffers.state == ["released"] * 3
    fwd, bwd, _ = run_step(schedule, NESTED_TREE, buffers)
    assert fwd == ["G0", "G1", "W0", "G2", "W1", "R1", "W2"]


def test_unpin_without_pin_is_an_error():
    schedule, _ = schedule_for(NESTED)
    with pytest.raises(RuntimeError, match="unpin"):
        schedule.unpin()
