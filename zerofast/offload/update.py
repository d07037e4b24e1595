"""The offloaded step: everything a step does because the optimizer state is not on the device, behind
the calls the optimizer makes at fixed points of its step (zerofast/optim/step.py):

  open_store(...)        where the state lives (a store of stores.py) and stage 3's shards' files, agreed on at construction
  OffloadedUpdate.apply  phase 3 through the store ([Note: offload schedule] in __init__.py), then on
                         disk the agreement that every rank wrote it ([Note: the all-or-none offloaded step]);
                         with the delayed update only its start, on a thread ([Note: the delayed update])
  OffloadedUpdate.flush  the delayed update in flight: waited for, agreed on, applied
  follow_params, check_writable   what the model was given between steps, taken into the master

It imports nothing of the optimizer and nothing compiled: the shard (zerofast/optim/state.py's
ShardState: the state's tensors, the kernel call over a range) is read through ShardSide, the ranks'
agreement through StepSide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from ..errors import OffloadError, StepNotAppliedError
from .stores import (
    DeviceState,
    DiskState,
    HostState,
    OffloadStats,
    ShardFiles,
    StateSpec,
    is_offloaded,
    views_of,
    window_layout,
)

__all__ = ["OffloadedUpdate", "ShardSide", "StepSide", "open_store", "open_shard_files", "agreed", "shard_specs"]


class ShardSide(Protocol):
    """What the offloaded step reads of the shard (ShardState)."""

    plan: object
    pieces: list
    follows_params: bool
    files: object  # stage 3's shards in files (stores.ShardFiles), or None

    def runs(self, used: list[bool], group_of: list[int]) -> list: ...

    def hyper(self, run, param_groups: list[dict], adamw: bool, grad_scale) -> dict: ...

    def grad_range(self, bucket: int, bucket_lo: int, state: slice) -> torch.Tensor: ...

    def master_and_copy(self, bucket: int, bucket_lo: int, state: slice): ...

    def step_range(self, views: dict[str, torch.Tensor], grad: torch.Tensor, **kw) -> None: ...

    def bind(self, views: dict[str, torch.Tensor]) -> None: ...

    def count_steps(self, used: list[bool]) -> None: ...

    def sync_params_from_master(self) -> None: ...

    def let_go(self, lo: int = 0, numel: int | None = None) -> None: ...


class StepSide(Protocol):
    """What the offloaded step asks of the optimizer's step (zerofast/optim/step.py)."""

    def agree(self, this_failed: bool, what: str, everyone: bool) -> int:
        """The rank that failed (-1: none). everyone: the largest failed rank over every rank of the
        model (a collective); else this rank's own, or -1."""
        ...

    def not_applied(self, what: str, failed: int) -> str:
        """This step's gradients dropped (nothing was applied); the note an error carries."""
        ...


def open_store(specs: list[StateSpec], shard_numel: int, plan, device, frozen_numel: int, rank: int, tp: bool):
    """(the store plan.offload places the state in, stage 3's shards' files or None): DeviceState (also
    "host" for a CPU model, unless the update is delayed), HostState or DiskState; open_shard_files.
    The store is closed if the files fail."""
    store = _open_store(specs, shard_numel, plan, device)
    try:
        return store, open_shard_files(plan, shard_numel, frozen_numel, device, rank, tp)
    except BaseException:
        store.close()
        raise


def _open_store(specs: list[StateSpec], shard_numel: int, plan, device: torch.device):
    policy = plan.offload
    if not is_offloaded(policy.state, policy.delayed_update, device.type):
        return DeviceState(specs, device, "host" if policy.state == "host" else "device")
    if policy.state == "host":
        return HostState(specs, pin=policy.pin_memory and device.type == "cuda")
    return DiskState(
        specs,
        shard_numel,
        policy.path,
        int(policy.window_mb * 2**20),
        policy.io_threads,
        plan.state_block if plan.quantized_state else 1,
        policy.direct_io,
        policy.keep_files,
    )


def shard_specs(plan, shard_numel: int, frozen_numel: int) -> list[StateSpec]:
    """The files of OffloadPolicy(params="disk"): stage 3's parameter shard (the parameters' dtype),
    gradient shard (the reduce's) and frozen parameters' shard ([Note: parameters on disk])."""
    return [
        StateSpec("param_shard", plan.param_dtype, shard_numel),
        StateSpec("grad_shard", plan.reduce_dtype, shard_numel),
        StateSpec("frozen_shard", plan.param_dtype, frozen_numel),
    ]


def open_shard_files(plan, shard_numel: int, frozen_numel: int, device: torch.device, rank: int, tp: bool):
    """OffloadPolicy(params=...) at stage 3 (resolve_plan refused it at stages 1 and 2): ShardFiles for
    "disk", None for "host" on a CPU model (its shards are in host memory already) and without it; the
    combinations not built are named errors here, at construction."""
    policy = plan.offload
    if policy.params is None:
        return None
    if device.type != "cpu":
        raise NotImplementedError(
            f"{plan.front}: OffloadPolicy(params={policy.params!r}) is built for models on the CPU; on {device} the "
            "shards' copies to and from the device on side streams are not built yet (ZeRO-Infinity's GPU "
            "schedule): use params=None there"
        )
    if tp:
        raise ValueError(
            f"{plan.front}: OffloadPolicy(params={policy.params!r}) does not apply to tensor parallelism's "
            "DTensor parameters: shard over 'dp' with params=None"
        )
    if policy.params == "host":
        return None
    return ShardFiles(shard_specs(plan, shard_numel, frozen_numel), policy.path, rank, policy.keep_files)


def agreed(build: Callable[[], tuple], plan, rank: int, agree: Callable[[int], int]) -> tuple:
    """build() -> (store, ...). On disk every rank first learns whether every other placed its files
    (agree: the largest failed rank, one small all_reduce), so a rank's full or unwritable disk is
    named on every rank at construction, not later as a dead peer."""
    if plan.offload.state != "disk" and plan.offload.params != "disk":
        return build()
    built, error = None, None
    try:
        built = build()
    except OffloadError as e:
        error = e
    failed = agree(-1 if error is None else rank)
    if error is not None:
        raise error
    if failed >= 0:
        for part in built:  # their files go now, not when the traceback lets go of them
            if hasattr(part, "close"):
                part.close()
        raise OffloadError(
            f"{plan.front}: rank {failed} could not place its files under OffloadPolicy(path="
            f"{plan.offload.path!r}) (see that rank's error); no rank built its optimizer"
        )
    return built


class OffloadedUpdate:
    """Phase 3 of a shard whose state a store holds off the device, and what it takes to make it all
    or none across ranks (disk) or one step late (the delayed update)."""

    def __init__(self, store, shard: ShardSide, shard_numel: int):
        self.store, self.shard, self.plan = store, shard, shard.plan
        self.delayed = self.plan.offload.delayed_update
        self._pending_used: list[bool] | None = None  # an update written, not yet committed
        self._delayed: _Delayed | None = None
        # Stage 3's shards in files, the state in memory: the step in two passes ([Note: the
        # all-or-none step with the state in memory]), over chunks of the disk's window size; the
        # gradients the first pass read, held for the second (lo, hi, hyper-parameters, gradient).
        self.two_pass = shard.files is not None and not isinstance(store, DiskState) and not self.delayed
        self._held: list[tuple[int, int, dict, torch.Tensor]] | None = None
        self.chunk = getattr(store, "chunk", 0)  # DiskState's window chunk
        if self.two_pass:
            block = self.plan.state_block if self.plan.quantized_state else 1
            self.chunk = window_layout(store.specs, shard_numel, int(self.plan.offload.window_mb * 2**20), block)[0]
        # The delayed update at stages 1 and 2: what zerofast last wrote into the owned parameters
        # (host, the parameters' dtype), against which the model's writes are found (_follow_writes).
        follows = shard.follows_params and self.delayed
        self._applied = torch.zeros(shard_numel, dtype=self.plan.param_dtype) if follows else None
        self.params_written()

    @property
    def placement(self) -> str:
        return self.store.placement

    @property
    def update_in_flight(self) -> bool:
        """A delayed update was started and not yet applied."""
        return self._delayed is not None

    @property
    def delayed_bytes(self) -> int:
        """Host memory held by the delayed update in flight (its gradient and parameter copies)."""
        return self._delayed.nbytes if self._delayed is not None else 0

    # --- the step's fixed points ----------------------------------------------------------------------

    def apply(self, update: Callable[[], None], side: StepSide) -> None:
        """Phase 3 (update(): the rule's, which runs apply_adam below). On disk every data-parallel
        rank then says whether it wrote its update, and all switch to it or none does ([Note: the
        all-or-none offloaded step]); with the delayed update it only starts, and flush() settles it."""
        if self.delayed:
            update()  # starts the thread
            return
        error = None
        try:
            update()
        except OffloadError as e:
            error = e
        self._settle(error, "this step's update", side)

    def flush(self, side: StepSide) -> bool:
        """The delayed update in flight, if any, waited for, agreed on and applied: the parameters and
        the state become those after it ([Note: the delayed update]). Collective while one is in
        flight; whether one was applied (stages 1 and 2 then gather the parameters)."""
        if self._delayed is None:
            return False
        error = self._delayed.wait()
        try:
            if error is not None and not isinstance(error, OffloadError):
                raise error
            self._settle(error, "the delayed update of the last step", side)
        except BaseException:
            self._delayed = None
            raise
        self._apply_delayed()
        return True

    def follow_params(self) -> None:
        """Before the state is read whole: the master takes what the model was given (the delayed
        update's way, against what zerofast last wrote; otherwise the shard's own follow_params())."""
        if self._applied is not None:
            self._follow_writes(())
        else:
            self.shard.follow_params()

    def check_writable(self) -> None:
        """Stage 3: a write to a parameter outside a step needs the state at rest."""
        if self._delayed is not None:
            from ..errors import ShardedParameterError

            raise ShardedParameterError(
                "a parameter was written while the delayed update of the last step is in flight "
                "(OffloadPolicy(delayed_update=True)): its thread writes the fp32 master. Call opt.flush() on "
                "every rank first, then write"
            )

    def _settle(self, error: BaseException | None, what: str, side: StepSide) -> None:
        """After an update was written (or failed) on this rank: on disk (the state's files or the
        shards'), the ranks agree whether every one wrote it; then it is the state everywhere, or
        nowhere and this raises."""
        failed = side.agree(error is not None, what, everyone=self.placement == "disk" or self.two_pass)
        if failed < 0:
            self._commit()
            return
        self._abort()
        note = side.not_applied(what, failed)
        if error is not None:
            error.add_note(note)
            raise error
        raise StepNotAppliedError(note + " (see that rank's error)")

    def _commit(self) -> None:
        """Every rank wrote the update: it is the state now, and its steps count."""
        self.store.commit()
        self.shard.bind(self.store.views())
        if self._held is not None:
            self._second_pass()
        if self._pending_used is not None:
            self.shard.count_steps(self._pending_used)
        self._pending_used = None

    def _abort(self) -> None:
        """Some rank failed to write its update: the state stays the store's last generation, and the
        parameters this rank updated in memory go back to that master's rounding."""
        self._pending_used = self._held = None
        self.shard.sync_params_from_master()
        self.params_written()

    # --- phase 3 through the store ----------------------------------------------------------------------

    def apply_adam(self, used: list[bool], param_groups: list[dict], group_of: list[int], adamw: bool, grad_scale):
        """The CPU kernel over each piece the store hands out (disk: a chunk of the window), gradients
        to the host, updated parameters (the master's rounding, or its fp32 copy) back to the device.
        Delayed: on a thread, from a copy of the gradients, into staging buffers flush() applies
        ([Note: the delayed update]). Counted only by the commit: [Note: the all-or-none offloaded step]."""
        shard, delayed = self.shard, self.delayed
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.to("cpu")  # one read of the device per step
        runs = shard.runs(used, group_of)
        segments = [
            (run.state_lo, run.state_lo + run.numel, (run, shard.hyper(run, param_groups, adamw, grad_scale)))
            for run in runs
        ]
        if delayed:  # what the model was given since the last update was applied, before the thread reads the master
            self._follow_writes(())
        grads = self._grad_snapshot(runs) if delayed else None
        staged: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # Stage 3's shards in files beside the state on disk: the step reads the gradients and writes
        # the parameters by explicit I/O, so a failure is an OffloadError naming the file and the rank,
        # settled all or none with the state's ([Note: parameters on disk] in __init__.py).
        files = shard.files if isinstance(self.store, DiskState) and not delayed else None
        scratch: dict[str, torch.Tensor] = {}

        def buffer(name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
            if name not in scratch or scratch[name].numel() < numel:
                scratch[name] = torch.empty(max(numel, self.chunk), dtype=dtype)
            return scratch[name][:numel]

        def step(payload, lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            run, hyper = payload
            at = run.bucket_lo + lo - run.state_lo
            if files is not None:  # stage 3: the shards' index is the state's; no copy to follow
                grad = buffer("grad", shard.grad_shard.dtype, hi - lo)
                files.read_into("grad_shard", lo, grad)
                copy = buffer("param", shard.param_shard.dtype, hi - lo)
                shard.step_range(views, grad, param_copy=copy, follow_copy=False, **hyper)
                files.write_from("param_shard", lo, copy)
                return
            if grads is None:
                grad = shard.grad_range(run.bucket, at, slice(lo, hi))
                grad = grad if grad.device.type == "cpu" else grad.to("cpu")
            else:
                grad = grads[run.state_lo][lo - run.state_lo : hi - run.state_lo]
            dest = shard.master_and_copy(run.bucket, at, slice(lo, hi))[1]
            direct = dest.device.type == "cpu" and not delayed
            # The kernel reads what the model holds and follows it; the delayed update follows at
            # flush() instead (the model may be written while its thread runs).
            follow = shard.follows_params and not delayed
            if direct:
                copy = dest
            else:
                copy = dest.to("cpu", copy=True) if follow else torch.empty(hi - lo, dtype=dest.dtype)
            shard.step_range(views, grad, param_copy=copy, follow_copy=follow, **hyper)
            if delayed:
                staged.append((dest, copy, lo))
            elif not direct:
                dest.copy_(copy)
            shard.let_go(lo, hi - lo)  # shards in files: this chunk's pages leave memory

        self._pending_used = list(used)
        if self.two_pass:
            self._first_pass(segments, buffer)
            return
        if isinstance(self.store, DiskState):
            self.store.release()  # pages a checkpoint touched since the last step
        if not delayed:
            self.store.stream(segments, step)
            return
        held = sum(g.numel() * g.element_size() for g in grads.values())
        held += sum(run.numel for run in runs) * self.plan.param_dtype.itemsize  # the staged parameters
        self._delayed = _Delayed(lambda: self.store.stream(segments, step), staged, held)

    # [Note: the all-or-none step with the state in memory]
    # Stage 3's shards in files with the state in host memory: the step's reads (the gradient shard)
    # and writes (the parameter shard) can fail, and the state, updated in place, has no generation
    # to go back to (DiskState's: [Note: the all-or-none offloaded step]). So the step runs twice.
    # The first pass reads each chunk's gradients by explicit I/O (held), steps a copy of the chunk's
    # state and writes the updated parameters to the file; nothing it did is the state yet. The ranks
    # agree; if every one wrote its parameters, the second pass steps the state in place from the held
    # gradients (no I/O, nothing that can fail: the same kernel on the same values, so the master is
    # the rounding's source the file already holds); otherwise the parameters are written back from
    # the untouched master. It costs a second kernel pass and, for the step, a copy of the gradient
    # shard in host memory (its bytes are a third of the fp32 state's or less); the state on disk
    # needs neither (its two generations are the undo).

    def _first_pass(self, segments: list, buffer: Callable) -> None:
        shard, files, store, chunk = self.shard, self.shard.files, self.store, self.chunk
        state = store.views()
        self._held = held = []
        start = time.perf_counter()
        for lo, hi, (_, hyper) in segments:
            a = lo
            while a < hi:
                b = min(hi, (a // chunk + 1) * chunk)  # chunks at multiples of `chunk`: 8-bit blocks whole
                grad = torch.empty(b - a, dtype=shard.grad_shard.dtype)
                files.read_into("grad_shard", a, grad)
                held.append((a, b, hyper, grad))
                views = views_of(store.specs, state, a, b).items()
                copies = {k: buffer(k, v.dtype, v.numel()).copy_(v) for k, v in views}  # reused: faulted in once
                params = buffer("param", shard.param_shard.dtype, b - a)
                shard.step_range(copies, grad, param_copy=params, follow_copy=False, **hyper)
                files.write_from("param_shard", a, params)
                a = b
        store.stats = OffloadStats(seconds=time.perf_counter() - start)

    def _second_pass(self) -> None:
        state = self.store.views()
        for a, b, hyper, grad in self._held:
            self.shard.step_range(views_of(self.store.specs, state, a, b), grad, param_copy=None, **hyper)
        self._held = None

    def _grad_snapshot(self, runs: list) -> dict[int, torch.Tensor]:
        """Each run's reduced gradients copied to the host, by its first shard element: the next
        backward writes the buffers they are in while the delayed update reads them."""
        shard = self.shard
        return {
            run.state_lo: shard.grad_range(run.bucket, run.bucket_lo, slice(run.state_lo, run.state_lo + run.numel)).to(
                "cpu", copy=True
            )
            for run in runs
        }

    # --- the delayed update ---------------------------------------------------------------------------------

    def _apply_delayed(self) -> None:
        """The parameters take the delayed update's values, except where the model was written since
        the last update was applied: the write wins, and the master takes it (the thread could not see it)."""
        staged = self._delayed.staged
        self._follow_writes(staged)
        for dest, copy, _ in staged:
            dest.copy_(copy)
        self._delayed = None
        self.params_written()

    def _follow_writes(self, staged) -> None:
        """An element that differs from what zerofast last wrote (self._applied) was written by the
        user: the staged values (the update in flight) and the master take it."""
        if self._applied is None:
            return
        shard = self.shard
        with torch.no_grad():
            for dest, copy, lo in staged:  # first: they compare against _applied as it was
                held = dest.to("cpu")
                copy.copy_(torch.where(held != self._applied[lo : lo + copy.numel()], held, copy))
            for pc in shard.pieces:
                state = slice(pc.state_offset, pc.state_offset + pc.numel)
                master, held = shard.master_and_copy(pc.bucket, pc.bucket_offset, state)
                held = held.to("cpu")
                changed = held != self._applied[state]
                if bool(changed.any()):
                    master.copy_(torch.where(changed.to(master.device), held.to(master.device, master.dtype), master))
                    self._applied[state].copy_(held)

    def params_written(self) -> None:
        """zerofast wrote the model's owned parameters (an update applied, a checkpoint loaded): the
        delayed update remembers what they hold now."""
        if self._applied is None:
            return
        shard = self.shard
        for pc in shard.pieces:
            state = slice(pc.state_offset, pc.state_offset + pc.numel)
            self._applied[state].copy_(shard.master_and_copy(pc.bucket, pc.bucket_offset, state)[1])


class _Delayed:
    """The delayed update's thread ([Note: the delayed update]) and the parameter values it stages."""

    def __init__(self, run, staged: list[tuple[torch.Tensor, torch.Tensor, int]], nbytes: int):
        self.staged, self.error, self.nbytes = staged, None, nbytes

        def body():
            try:
                run()
            except BaseException as e:  # noqa: BLE001 (raised where the update is applied)
                self.error = e

        self.thread = threading.Thread(target=body, name="zerofast-delayed-update", daemon=False)
        self.thread.start()

    def wait(self) -> BaseException | None:
        self.thread.join()
        return self.error
