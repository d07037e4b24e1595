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

The package: replicas.py (ReplicaGroups: the quorum, the agreement, the commit and the state that heals, through
zerofast.topology's Replication) and transport.py (SafeTransport: the state on the wire without pickle). Written
against torchft 0.2.0 (the Makefile's FT_DEPS): RELIES_ON below is checked at import (zerofast.integrations.hosts).

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
"""

from __future__ import annotations

from torchft.checkpointing.transport import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo

from .. import hosts

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


from .replicas import LayoutMismatchError, ReplicaGroups  # noqa: E402 (after the host check)
from .transport import SafeTransport  # noqa: E402
