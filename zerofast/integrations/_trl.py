"""TRL's generation on a stage-3 policy: ds3_gather_for_generation chooses between the whole model
gathered and unit by unit ([Note: generation on stage 3] in zerofast/stage3/schedule.py).

Imported by ZeroTrainerMixin only where trl is (zerofast.integrations.hf), written against trl
1.16.0 (the Makefile's HF_DEPS): RELIES_ON below is checked at import.

[Note: TRL's generation mode]
GRPOTrainer and RLOOTrainer 1.16.0 generate inside `self._dist.summon_full_params(model_wrapped,
recurse=False)`, their DistributedBackend's context for FSDP v1 (a no-op otherwise), and nowhere
else call it: the one place that wraps exactly their generate() calls. Their
`ds3_gather_for_generation` (default True) says whether DeepSpeed ZeRO-3 gathers the whole model
for generation; for a stage-3 ZeroAdam the same choice is opt.gathered_params() (the whole model
per rank, no collective per token) or not (unit by unit, the shard plus two units, every unit
gathered per token, generate() synced). So the trainer's DistributedBackend gets a class of its
own (as the Trainer's accelerator does: [Note: the Trainer's accelerator] in hf.py) whose
summon_full_params enters opt.gathered_params() when the policy is stage 3 and the option is on,
and does what TRL's does otherwise.
"""

from __future__ import annotations

import contextlib
import weakref

from trl.distributed import DistributedBackend

from . import hosts
from .hf import TRL


class _ZeroGeneration(DistributedBackend):
    """The trainer's DistributedBackend, moved into this class: [Note: TRL's generation mode]."""

    _trainer = None  # a weak reference to the trainer

    @contextlib.contextmanager
    def summon_full_params(self, module, **kwargs):
        trainer = self._trainer() if self._trainer is not None else None
        opt = getattr(trainer, "optimizer", None)
        gather = (
            opt is not None
            and getattr(opt, "plan", None) is not None
            and opt.plan.params_sharded
            and getattr(trainer.args, "ds3_gather_for_generation", True)
            and trainer.accelerator.unwrap_model(module) is opt.model
        )
        if not gather:
            with super().summon_full_params(module, **kwargs):
                yield
            return
        with opt.gathered_params():
            yield


def adopt(trainer) -> None:
    """Give a TRL trainer's DistributedBackend (if it has one) the generation mode of [Note: TRL's
    generation mode]."""
    backend = getattr(trainer, "_dist", None)
    if type(backend) is DistributedBackend:
        backend.__class__ = _ZeroGeneration
        backend._trainer = weakref.ref(trainer)


RELIES_ON = hosts.Reliance(
    "zerofast.integrations._trl",
    extra="hf",
    pins=(TRL,),
    entries=(
        hosts.Overrides(_ZeroGeneration, DistributedBackend, ("summon_full_params",)),
        hosts.Calls(DistributedBackend, "summon_full_params", 1),
    ),
)
hosts.check(RELIES_ON)
