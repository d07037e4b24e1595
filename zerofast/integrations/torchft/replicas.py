"""ReplicaGroups: this replica group on torchft, given to ZeroAdam as process_group, as zerofast.topology's
ReplicaSource and Replication ([Note: replica groups on torchft] in __init__.py)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo

from ...topology import Topology
from .transport import LayoutMismatchError, SafeTransport

# --- the replicate dimension -----------------------------------------------------------------------


class ReplicaGroups:
    """This process's replica group on torchft, given to ZeroAdam or ZeroMuon as process_group. See
    [Note: replica groups on torchft].

    replica_id: this group's name (the same on its K ranks). lighthouse: the Lighthouse's address (default:
    $TORCHFT_LIGHTHOUSE). The replica group's K ranks are the default group's: one c10d world (and TCPStore,
    which torchft's Manager joins unprefixed) per replica group, e.g. one torchrun per machine; they shard the
    state. min_replicas: a step commits only with at least this many groups. timeout: every collective and the
    quorum's wait; a Lighthouse that does not answer within it is a named error. manager: a torchft Manager
    made by the caller instead (its pg, transport and callbacks as this class would make them)."""

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
