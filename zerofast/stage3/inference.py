"""Models sharded for inference only: a reference, reward or judge model beside the policy that a
ZeroAdam trains, held as stage-3 units with no optimizer (`zerofast.shard_frozen`).

[Note: models sharded for inference only]
RL post-training keeps frozen models beside the policy (DPO's and GRPO's reference, a reward
model): kept whole on every rank, each costs the whole model per rank. shard_frozen() shards one
exactly as stage 3 shards a trained model's frozen parameters ([Note: frozen parameters in stage 3]
in zerofast/stage3/frozen.py), with the same code: units.py plans the units, frozen.py lays out the
frozen part and builds its FrozenShard and gather-only BucketComm, runtime.py's UnitBuffers and
UnitTracker gather and release each unit around the modules that use it (the schedule of
schedule.py, two units in flight), and a model host (zerofast/integrations/hf_generation.py, once
imported: extensions.py) makes generate() sync the ranks. Only what is absent differs from ZeroAdam's
frozen part: no trainable part (the frozen part is the UnitBuffers' only one) and no optimizer.
  - Every parameter is frozen (requires_grad=False): the model is never trained through this.
  - Precision: `mixed_precision` as ZeroAdam takes it. A low-precision policy converts the model's
    floating parameters and buffers to that dtype and casts floating inputs, as ZeroAdam's mixed
    precision does to the policy ([Note: mixed precision] in zerofast/optim/precision.py): a
    reference model loaded from the policy's weights then holds bitwise the policy's parameters at
    step 0 (both are the fp32 weights rounded to nearest), so the two give identical log-probs.
  - Process group: its gathers run on a group of their own (the same ranks as `process_group`,
    its timeout), so they never pair up with the collectives of a ZeroAdam on the same ranks,
    whose reduces are issued during backward in an order set by timing.
  - Ranks must run the same number of forwards, as any stage-3 model ([Note: generation on stage
    3] in schedule.py): generate() is synced by zerofast; a loop of one's own, or ranks with
    different numbers of batches, run inside gathered_params(), or every rank calls generate()
    the same number of times (docs/rl.md shows both).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..config import offload_policy, precision_policy, unit_policy
from ..guard.modules import holders
from ..guard.params import forget, manage
from ..model_setup import check_plain_parameters, in_precision, join_ranks
from ..offload import ShardFiles, StateSpec
from ..topology import ReplicaSource, check_process_group, data_parallel_group, second_group
from .frozen import FrozenShard, frozen_part
from .module import ShardedModule
from .runtime import UnitBuffers, UnitTracker
from .units import hook_needs, inference_plan

WHO = "shard_frozen"
_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its ShardedFrozenModel


class ShardedFrozenModel(ShardedModule):
    """What shard_frozen() returns: the model (called as before: its forwards gather unit by unit)
    and the whole-model access a ZeroAdam gives (gathered_params(), named_full_tensors(),
    full_state_dict(): the same handle, zerofast/stage3/module.py)."""

    def __init__(
        self,
        model: nn.Module,
        units: UnitTracker,
        frozen: FrozenShard,
        hooks: list,
        slots: list,
        module_classes: dict,
        files: ShardFiles | None = None,
    ):
        super().__init__(model, units, hooks)
        self._frozen, self.files = frozen, files  # files: the shard on disk (offload=), removed with the model
        self._slots, self._module_classes = slots, module_classes  # [Note: the model stays a torch model]

    @property
    def dtype(self) -> torch.dtype:
        """The sharded parameters' dtype."""
        return self._frozen.dtype

    def parameter_bytes(self) -> dict[str, int]:
        """This rank's parameter storage now: "shard" (its part of every unit, in memory) and
        "gathered" (the unit buffers that exist at the moment); with the shard on disk "shard" is 0,
        "disk" the file's bytes and "resident" its pages this process holds now."""
        shard = self._frozen.shard
        out = {
            "shard": 0 if self.files else shard.numel() * shard.element_size(),
            "gathered": sum(b.untyped_storage().nbytes() for b in self._frozen.buffers),
        }
        if self.files is not None:
            out.update(disk=self.files.disk_bytes, resident=self.files.resident_bytes())
        return out

    def remove_hooks(self) -> None:
        """Take every hook off the model (its parameters stay views of released unit buffers: the
        model is unusable afterwards; for tearing down)."""
        super().remove_hooks()
        forget(self._slots)
        restore_classes(self._module_classes)
        self._slots, self._module_classes = [], {}
        _SHARDED.pop(self.model, None)


def shard_frozen(
    model: nn.Module, process_group: dist.ProcessGroup | None = None, *, mixed_precision=None, units=None, offload=None
) -> ShardedFrozenModel:
    """Shard `model` for inference only across `process_group` (None: the world; a 2-D DeviceMesh:
    every rank of it), as stage-3 units with no optimizer: each rank keeps 1/N of the parameters,
    and a forward gathers two units at a time ([Note: models sharded for inference only]).
    Every parameter is frozen; every rank calls it, with the same model (rank 0's values are
    broadcast). mixed_precision: None (the model's own dtype), "bf16", "fp16" or a
    MixedPrecisionPolicy: the policy's, so that a reference model loaded from the same weights
    gives the policy's log-probs bitwise. units: stage 3's units as ZeroAdam takes them. offload:
    OffloadPolicy(params="disk", path=PATH) (or "host": on a CPU model nothing moves): this rank's
    shard in a file, as ZeroAdam's stage 3 keeps its own ([Note: parameters on disk] in
    zerofast/offload/__init__.py); a frozen model has no optimizer state, so state= is an error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{WHO}: model must be an nn.Module; got {type(model).__name__}")
    placement = _params_placement(offload)
    if model in _SHARDED:
        raise ValueError(
            f"{WHO}: this {type(model).__name__} is sharded already (shard_frozen was called on it before)"
        )
    check_plain_parameters(model, WHO)
    if isinstance(process_group, ReplicaSource):
        raise TypeError(
            f"{WHO}: process_group must be a ProcessGroup, a DeviceMesh or None; got {type(process_group).__name__} "
            f"(replica groups that bring their own Replication are for training)"
        )
    check_process_group(process_group)
    param_dtype = precision_policy(mixed_precision, WHO).param_dtype if mixed_precision is not None else None
    unit_p = unit_policy(units)
    group, _, _ = data_parallel_group(process_group, None)
    for p in model.parameters():
        p.requires_grad_(False)
    hooks = in_precision(model, param_dtype)
    join_ranks(model, group, WHO)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    named, plan, layout, bucket_of = inference_plan(model, param_dtype, unit_p, world, WHO)
    params = [p for _, p in named]
    files = None
    if placement is not None:
        if params[0].device.type != "cpu":
            raise NotImplementedError(
                f"{WHO}: offload=OffloadPolicy(params={placement.params!r}) is built for models on the CPU; on "
                f"{params[0].device} the shard's copies to and from the device are not built yet"
            )
        if placement.params == "disk":
            spec = StateSpec("frozen_shard", params[0].dtype, layout.shard_numel(rank))
            files = ShardFiles([spec], placement.path, dist.get_rank(), placement.keep_files)
    shard = files.tensors["frozen_shard"] if files is not None else None
    frozen, comm = frozen_part(
        named, layout, bucket_of, rank, group, second_group(group, group), params[0].dtype, shard=shard
    )
    let_go = files.let_go_all if files is not None else None
    buffers = UnitBuffers(frozen.buffers, frozen.shard, frozen.layout, rank, comm, frozen.bucket_of, let_go=let_go)
    if files is not None:
        buffers.parts[0].read_from(files.reader("frozen_shard"))
    buffers.shard_out()
    # [Note: the model stays a torch model] in zerofast/guard/__init__.py
    slots = manage(named, WHO)
    module_classes = own_classes(holders(model, params))
    buffers.guard([slots])
    tracker = UnitTracker(model, hook_needs(model, params, plan), buffers)
    handle = ShardedFrozenModel(model, tracker, frozen, hooks, slots, module_classes, files)
    _SHARDED[model] = handle
    return handle


def _params_placement(offload):
    """shard_frozen's offload=: None, or an OffloadPolicy with params= and no state."""
    if offload is None:
        return None
    policy = offload_policy(offload, WHO)
    if policy.state is not None or policy.params is None:
        raise ValueError(
            f"{WHO}: offload places the parameters of a model sharded for inference: OffloadPolicy(params='disk', "
            f"path=PATH) or params='host'; it has no optimizer state to offload; got {offload!r}"
        )
    return policy


def sharded_frozen_of(model: nn.Module) -> ShardedFrozenModel | None:
    """The handle shard_frozen() returned for `model`, or None if it was never sharded so."""
    return _SHARDED.get(model)
