"""Training that survives a lost replica group, on torchft: ZeroAdam's replicate dimension through a
torchft Manager, so a replica group can die and the others train on without a restart, and a
relaunched group heals from a live peer.

    from zerofast.integrations.torchft import ReplicaGroups

    replicas = ReplicaGroups("group-0", lighthouse="http://lighthouse:29510")  # this group's K ranks
    opt = ZeroAdam(model, stage=2, process_group=replicas)
    while replicas.step < steps:
        opt.zero_grad()               # the step's quorum: a joining group receives the state here
        loss = model(*batch(replicas.step)).loss
        loss.backward()
        opt.step()                    # applied only if torchft commits the step

[Note: replica groups on torchft]
Hybrid sharding ([Note: hybrid sharding] in zerofast/topology.py) makes every replica group hold the
whole training state, so a replica group is the unit of fault tolerance. Here a replica group is its
own c10d world of K ranks (its shard group: it reduces, gathers and agrees within itself exactly as
flat ZeRO over K ranks), and the replicate dimension is torchft's ManagedProcessGroup, whose
membership the Lighthouse's quorum sets anew each step. The parts:
- The quorum: opt.zero_grad() starts it (as torchft's OptimizerWrapper does), once per step, and
  waits for it (use_async_quorum=False): a group that is behind receives the state then, before its
  forward, on the main thread; at the first one every group starts from the same state (torchft's
  init_sync). So zero_grad() comes before each step's forward; step() without a quorum since the
  last one is an error that says so.
- The gradient: the engine all_reduces each owned range over the managed group during backward, one
  tensor per call (the managed group takes single tensors: stage 1's ranges are not coalesced), a SUM;
  the average divides by K x this step's participants (Topology.divisor()), not by a fixed world.
- The agreement: the shard group's MAX, then, after every gradient all_reduce of the step has
  finished (collectives on the one managed group pair by order), the MAX over the participants. A
  failed managed collective raises nothing (torchft records it): the flags fall back to the shard
  group's and the commit says no.
- The commit: exactly one manager.should_commit() per step on every rank, after the reduces and the
  agreement, before Adam, the loss-scale update and the gather. No: nothing is applied and the step is
  not counted (all-or-none, as a failed step; opt.step_was_skipped is True). A step that raises before
  it reports the error to torchft and still takes its one decision.
- The state a recovering rank receives from the same rank of a live group (both hold the same layout:
  K and the model are checked on arrival): every flat tensor of the shard (the fp32 master, the
  moments and 8-bit scales, the parameters: stages 1-2 whole, stage 3 this rank's shard; stage 3's
  frozen shard), the per-parameter step counts, the loss scale, the param groups' hyper-parameters,
  zerofast's step count, torch's RNG, and whatever the user tracks (an LR scheduler, the data
  position: ReplicaGroups.track). Loading copies in place and issues no collective.
- The transport: SafeTransport sends a JSON header (the structure, every non-tensor value, each
  tensor's dtype and shape) and then each tensor's bytes over torchft's process group; the receiver
  parses JSON and checks dtypes and sizes, so nothing a peer sends is unpickled. torchft's own
  transports both unpickle what a peer sends (HTTPTransport the whole state, PGTransport its header),
  which runs any code a compromised or mismatched peer chooses.

Written against torchft 0.2.0 (the Makefile's FT_DEPS): Manager's start_quorum, should_commit,
num_participants, current_step, allreduce, errored, report_error, register_state_dict_fn;
ManagedProcessGroup; CheckpointTransport's interface. Checked at import (zerofast.integrations.hosts).
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist
from torchft.checkpointing.transport import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo

from ..topology import Topology
from . import hosts

__all__ = ["ReplicaGroups", "SafeTransport", "LayoutMismatchError"]

RELIES_ON = hosts.Reliance(
    integration="zerofast.integrations.torchft",
    extra="torchft",
    pins=(hosts.Pin("torchft", tested="0.2.0", supported=">=0.2.0,<0.3"),),
    entries=(
        hosts.Calls(
            Manager,
            "__init__",
            0,
            (
                "pg",
                "load_state_dict",
                "state_dict",
                "min_replica_size",
                "use_async_quorum",
                "timeout",
                "quorum_timeout",
                "connect_timeout",
                "rank",
                "world_size",
                "lighthouse_addr",
                "replica_id",
                "checkpoint_transport",
                "store_addr",
                "store_port",
                "hostname",
            ),
        ),
        hosts.Calls(Manager, "allreduce", 1, ("reduce_op",)),
        hosts.Calls(Manager, "register_state_dict_fn", 3),
        hosts.Reads(Manager, ("start_quorum", "should_commit", "num_participants", "current_step", "errored")),
        hosts.Reads(Manager, ("report_error", "shutdown", "participating_rank")),
        hosts.Calls(ManagedProcessGroup, "__init__", 1),
        hosts.Reads(CheckpointTransport, ("metadata", "send_checkpoint", "recv_checkpoint", "disallow_checkpoint")),
        hosts.Calls(ProcessGroupGloo, "__init__", 0, ("timeout",)),
    ),
)
hosts.check(RELIES_ON)


class LayoutMismatchError(RuntimeError):
    """A replica group's state cannot be healed from its peer: they shard it differently."""


# --- the transport ---------------------------------------------------------------------------------

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
_MAX_HEADER = 64 << 20  # bytes: a header is the structure of a state dict, never its data


class SafeTransport(CheckpointTransport):
    """torchft's checkpoint transport without pickle: a JSON header, then each tensor's bytes, over
    torchft's process group (the replicas' ranks). See [Note: replica groups on torchft]."""

    def __init__(self, pg: dist.ProcessGroup, timeout: datetime.timedelta):
        self._pg, self._timeout = pg, timeout

    def metadata(self) -> str:
        return "zerofast-safe-transport"

    def disallow_checkpoint(self) -> None:
        pass  # send_checkpoint returns once every byte is sent: nothing reads the state after it

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        tensors: list[torch.Tensor] = []
        header = json.dumps({"step": step, "state": _encode(state_dict, tensors)}).encode()
        works = []
        length = torch.tensor([len(header)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8).clone()  # owns its bytes while in flight
        payloads = [length, body] + [_bytes_of(t) for t in tensors]
        for dst in dst_ranks:
            for tag, payload in enumerate(payloads):
                works.append(self._pg.send([payload], dst, tag=tag))
        for w in works:
            w.wait(timeout)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        if metadata != self.metadata():
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: the peer sends its state with {metadata!r}, not "
                f"{self.metadata()!r}: every replica group must use SafeTransport"
            )
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, tag=0).wait(timeout)
        n = int(length.item())
        if not 0 < n <= _MAX_HEADER:
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: a state header of {n} bytes from rank {src_rank}"
            )
        body = torch.empty(n, dtype=torch.uint8)
        self._pg.recv([body], src_rank, tag=1).wait(timeout)
        header = json.loads(body.numpy().tobytes())
        if header.get("step") != step:
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: the state received is of step {header.get('step')}, not {step}"
            )
        specs: list[tuple[torch.dtype, list[int]]] = []
        state = _decode(header["state"], specs)
        received = []
        for i, (dtype, shape) in enumerate(specs):
            t = torch.empty(shape, dtype=dtype)
            self._pg.recv([_bytes_of(t)], src_rank, tag=2 + i).wait(timeout)
            received.append(t)
        return _fill(state, received)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def _encode(value, tensors: list):
    """JSON-able: tensors replaced by their place in `tensors`, tuples as lists."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"__tensor__": len(tensors) - 1, "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"zerofast.integrations.torchft: state keys must be strings; got {list(value)!r}")
        return {k: _encode(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"zerofast.integrations.torchft: a state value of type {type(value).__name__} cannot be sent "
        f"(tensors, numbers, strings, lists and dicts can)"
    )


def _decode(value, specs: list):
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = _DTYPES.get(value.get("dtype"))
        shape = value.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise LayoutMismatchError(f"zerofast.integrations.torchft: a tensor described as {value!r}")
        specs.append((dtype, shape))
        return _Slot(len(specs) - 1)
    if isinstance(value, dict):
        return {k: _decode(v, specs) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, specs) for v in value]
    return value


class _Slot:
    def __init__(self, index: int):
        self.index = index


def _fill(value, tensors: list):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    return value


# --- the replicate dimension -----------------------------------------------------------------------


class ReplicaGroups:
    """This process's replica group on torchft, given to ZeroAdam or ZeroMuon as process_group. See
    [Note: replica groups on torchft].

    replica_id: this group's name (the same on its K ranks). lighthouse: the Lighthouse's address
    (default: $TORCHFT_LIGHTHOUSE). The replica group's K ranks are the default group's: one c10d
    world (and TCPStore, which torchft's Manager joins unprefixed) per replica group, e.g. one torchrun
    per machine; they shard the state. min_replicas: a step commits
    only with at least this many groups. timeout: every collective and the quorum's wait; a
    Lighthouse that does not answer within it is a named error. manager: a torchft Manager made by
    the caller instead (its pg, transport and callbacks as this class would make them)."""

    def __init__(
        self,
        replica_id: str | None = None,
        *,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        timeout: float = 60.0,
        manager: Manager | None = None,
    ):
        if not (isinstance(min_replicas, int) and min_replicas >= 1):
            raise ValueError(f"ReplicaGroups: min_replicas must be an int >= 1; got {min_replicas!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"ReplicaGroups: timeout must be a positive number of seconds; got {timeout!r}")
        if not dist.is_initialized():
            raise RuntimeError(
                "ReplicaGroups needs torch.distributed initialized: the replica group's own ranks "
                "(dist.init_process_group, one world per replica group)"
            )
        self.group = dist.group.WORLD
        self._tracked: dict[str, object] = {}
        self._view = None  # the optimizer's checkpoint view, once attached
        self._quorum_open = False  # a quorum was started since the last commit decision
        if manager is None:
            manager = self._make_manager(replica_id, lighthouse, min_replicas, timeout)
        self.manager = manager
        self.managed = ManagedProcessGroup(manager)

    def _make_manager(self, replica_id, lighthouse, min_replicas, timeout) -> Manager:
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError(
                "ReplicaGroups: lighthouse=None and $TORCHFT_LIGHTHOUSE is not set: where is the Lighthouse?"
            )
        if not (isinstance(replica_id, str) and replica_id):
            raise ValueError(f"ReplicaGroups: replica_id must be a non-empty string; got {replica_id!r}")
        td = datetime.timedelta(seconds=timeout)
        pg = ProcessGroupGloo(timeout=td)
        host, port = _store_address()
        try:
            return Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=min_replicas,
                use_async_quorum=False,
                timeout=td,
                quorum_timeout=td,
                connect_timeout=td,
                rank=dist.get_rank(self.group),
                world_size=dist.get_world_size(self.group),
                store_addr=host,
                store_port=port,
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                hostname=host,
                checkpoint_transport=SafeTransport(pg, td),
            )
        except RuntimeError as e:
            raise ConnectionError(
                f"ReplicaGroups: no Lighthouse at lighthouse={lighthouse!r} answered within timeout={timeout:g} s "
                f"(start one: `torchft_lighthouse --min_replicas 1`, or torchft.coordination.LighthouseServer)"
            ) from e

    # --- for the user's loop ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps: the data position to read the next batch from (healed with the state)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    @property
    def saves(self) -> bool:
        """Whether this rank's group saves checkpoints: the first participating group (one copy of
        the state is enough; each group's save is a plain K-rank checkpoint)."""
        return self.manager.participating_rank() == 0

    def track(self, name: str, obj) -> None:
        """Heal `obj` (an LR scheduler, a data loader position: anything with state_dict() and
        load_state_dict() of tensors, numbers, strings, lists and dicts) with the optimizer's state."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"ReplicaGroups.track: {name}={obj!r} has no state_dict()/load_state_dict()")
        if name in self._tracked or name == "zerofast":
            raise ValueError(f"ReplicaGroups.track: name={name!r} is taken")
        self._tracked[name] = obj

    # --- what the optimizer calls: zerofast.topology's ReplicaSource and Replication ---------------

    changes_membership = True

    def topology(self, group: dist.ProcessGroup, plan) -> Topology:
        """The replica group's own ranks shard the state, so it takes no shard_size of its own, and
        the collective checks, which gather over the replicate group, do not run on torchft's
        managed group."""
        if plan.shard_size is not None:
            raise ValueError(
                f"ZeroAdam: with torchft's replica groups as process_group, each replica group's ranks shard "
                f"the state; pass no CommPolicy.shard_size (got shard_size={plan.shard_size!r})"
            )
        if plan.check_collectives:
            raise ValueError(
                "ZeroAdam: CommPolicy(check_collectives=True) is not supported with torchft's replica groups "
                "(the checks gather over the replicate group, which torchft's managed group does not carry)"
            )
        rank, k = dist.get_rank(group), dist.get_world_size(group)
        return Topology(group, rank, k, group, rank, k, self.managed, 2, replication=self)

    def attach(self, opt) -> None:
        """The optimizer is built: its state (opt.checkpoint_view) joins what heals, at its first
        zero_grad()'s quorum."""
        self._view = opt.checkpoint_view
        self.manager.register_state_dict_fn("zerofast", self._load, self._state)

    def begin_step(self) -> None:
        """Start (and wait for) this step's quorum, once per step: opt.zero_grad() calls it."""
        if self._quorum_open:
            return
        self._view.quiesce()  # nothing in flight while a peer reads or writes the state
        self.manager.start_quorum()
        self._quorum_open = True

    def check_step(self, step: int) -> None:
        if not self._quorum_open:
            raise RuntimeError(
                "ZeroAdam.step() on torchft: no quorum was started for this step; call opt.zero_grad() "
                "before each step's forward (it starts the quorum, in which a recovering group heals)"
            )

    def participants_now(self) -> int:
        return self.manager.num_participants()

    def agree(self, flags: torch.Tensor) -> None:
        shard = flags.clone()
        self.manager.allreduce(flags, reduce_op=dist.ReduceOp.MAX).wait()
        if self.manager.errored() is not None:
            flags.copy_(shard)  # undefined after a failed collective; the commit will say no

    def commit(self) -> bool:
        self._quorum_open = False
        return self.manager.should_commit()

    def on_error(self, error: BaseException) -> None:
        """The step raised before its commit: torchft learns of it, and the step still takes its one
        decision (no), so every rank's count of decisions stays the same."""
        self._quorum_open = False
        self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(repr(error)))
        self.manager.should_commit()

    # --- the state that heals: the optimizer's checkpoint view ------------------------------------

    def _state(self) -> dict:
        view = self._view
        return {
            "layout": _fingerprint(view),
            "tensors": view.flat_state(),
            "steps": view.step_counts(),
            "where_step": view.steps_taken(),
            "scaler": dict(view.loss_scaler_state()),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in view.param_groups],
            "rng": torch.get_rng_state(),
            "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
        }

    def _load(self, state: dict) -> None:
        view = self._view
        mine = _fingerprint(view)
        if state["layout"] != mine:
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: this replica group cannot heal from its peer: the peer "
                f"shards the state as {state['layout']}, this group as {mine}. Every replica group must "
                f"have the same number of ranks, stage, partition, precision and model"
            )
        with torch.no_grad():
            for name, mine_t in view.flat_state().items():
                mine_t.copy_(state["tensors"][name])
        view.set_step_counts(state["steps"])
        view.set_steps_taken(state["where_step"])
        view.load_loss_scaler_state(state["scaler"])
        for group, saved in zip(view.param_groups, state["param_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
        torch.set_rng_state(state["rng"])
        for name, obj in self._tracked.items():
            obj.load_state_dict(state["tracked"][name])


def _fingerprint(view) -> dict:
    """What two ranks must share to copy each other's flat state: the shard's size and rank, the
    configuration, and every flat tensor's dtype and size."""
    facts = view.facts
    return {
        "shard_size": facts.shard_size,
        "shard_rank": facts.shard_rank,
        "stage": facts.stage,
        "partition": facts.partition,
        "tensors": {k: [str(v.dtype), v.numel()] for k, v in view.flat_state().items()},
        "params": [[n, list(p.shape)] for n, p in view.trainable.params],
    }


def _store_address() -> tuple[str, int]:
    """The host and port of the replica group's TCPStore (torchft's Manager joins it as a client):
    torchrun's, and init_process_group's env:// rendezvous, are MASTER_ADDR:MASTER_PORT."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host is None or port is None:
        raise ValueError(
            "ReplicaGroups: the replica group's store address is unknown (MASTER_ADDR/MASTER_PORT are not "
            "set); pass a torchft Manager made for it as manager="
        )
    return host, int(port)
