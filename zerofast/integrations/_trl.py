"""TRL's trainers on a stage-3 policy: adopt() gives a trainer's DistributedBackend the generation mode
ds3_gather_for_generation asks for ([Note: generation on stage 3] in zerofast/stage3/schedule.py), and its
VLLMGeneration the weight iterator's weights. Imported by ZeroTrainerMixin (hf.py) only where trl is; written
against trl 1.16.0 (the Makefile's HF_DEPS): RELIES_ON below is checked at import.

[Note: TRL's generation mode]
GRPOTrainer and RLOOTrainer 1.16.0 generate inside `self._dist.summon_full_params(model_wrapped,
recurse=False)`, their DistributedBackend's context for FSDP v1 (a no-op otherwise), and call it nowhere
else: the one place that wraps exactly their generate() calls. Their `ds3_gather_for_generation`
(default True) says whether DeepSpeed ZeRO-3 gathers the whole model for generation; for a stage-3
ZeroAdam the same choice is opt.gathered_params() (the whole model per rank, no collective per token)
or not (unit by unit: the shard plus two units, every unit gathered per token, generate() synced). So
the trainer's DistributedBackend gets a class of its own (as the Trainer's accelerator does:
[Note: the Trainer's accelerator] in hf.py) whose summon_full_params enters opt.gathered_params() when
the policy is stage 3 and the option is on, and does what TRL's does otherwise.

[Note: TRL's vLLM weight sync]
With use_vllm, GRPOTrainer and RLOOTrainer 1.16.0 keep a VLLMGeneration (trainer.vllm_generation)
whose sync_weights() sends the policy's weights to vLLM after each step, in both modes (server:
VLLMClient.update_named_params, after a first pass that collects names, dtypes and shapes;
colocate: load_weights one tensor at a time). Both read one generator, `_iter_named_params()`,
which every rank runs to its end. Outside DeepSpeed and FSDP it reads named_parameters() as they
are: on a stage-3 policy those have no storage, and with PEFT it merges the adapters into the
training parameters in place and unmerges them after (merge_adapter / unmerge_adapter), which
leaves the rounding of w + d - d in weights that ZeroAdam at stages 1 and 2 keeps. So the trainer's
VLLMGeneration gets a class of its own whose _iter_named_params is opt.named_full_tensors(): one
unit gathered at a time, and for a PEFT model peft="merged", merge_and_unload()'s names and values
bitwise, the model untouched ([Note: merged weights unit by unit] in peft_weights.py); names pass
through TRL's own _fix_param_name_to_vllm. What is sent is the state_dict's entries: tied weights
under each name (vLLM's loaders skip a tied head) and persistent buffers, where TRL sends
named_parameters().
"""

from __future__ import annotations

import contextlib
import importlib.util
import weakref

from accelerate.utils import is_peft_model
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration

from ..optim.base import ZeroOptimizer
from . import hf_generation, hosts  # noqa: F401 (hf_generation registers itself: below)

# Imported to register with stage 3 ([Note: stage-3 extension points] in zerofast/stage3/extensions.py):
# hf_generation as a model host (generate() synced), peft_weights the merged weights vLLM gets from a PEFT policy.
if importlib.util.find_spec("peft") is not None:
    from . import peft_weights  # noqa: F401


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


class _ZeroWeightSync(VLLMGeneration):
    """The trainer's VLLMGeneration, moved into this class: [Note: TRL's vLLM weight sync]."""

    _trainer = None  # a weak reference to the trainer

    def _iter_named_params(self):
        trainer = self._trainer() if self._trainer is not None else None
        opt = getattr(trainer, "optimizer", None)
        if not isinstance(opt, ZeroOptimizer) or opt.model is not self.model:
            yield from super()._iter_named_params()
            return
        for name, tensor in opt.named_full_tensors(peft="merged" if is_peft_model(self.model) else None):
            yield self._fix_param_name_to_vllm(name), tensor


def adopt(trainer) -> None:
    """Move a TRL trainer's DistributedBackend (if any) and VLLMGeneration (with use_vllm) into the classes
    above: [Note: TRL's generation mode], [Note: TRL's vLLM weight sync]."""
    backend = getattr(trainer, "_dist", None)
    if type(backend) is DistributedBackend:
        backend.__class__ = _ZeroGeneration
        backend._trainer = weakref.ref(trainer)
    generation = getattr(trainer, "vllm_generation", None)
    if type(generation) is VLLMGeneration:
        generation.__class__ = _ZeroWeightSync
        generation._trainer = weakref.ref(trainer)


# trl for this module and hf.py's TRL trainers: the Makefile's HF_DEPS pin (tested), extra `hf`'s range (supported).
TRL = hosts.Pin("trl", tested="1.16.0", supported=">=1.16.0,<1.17")
RELIES_ON = hosts.Reliance(
    "zerofast.integrations._trl",
    extra="hf",
    pins=(TRL,),
    entries=(
        hosts.Overrides(_ZeroGeneration, DistributedBackend, ("summon_full_params",)),
        hosts.Calls(DistributedBackend, "summon_full_params", 1),
        hosts.Overrides(_ZeroWeightSync, VLLMGeneration, ("_iter_named_params",)),
        hosts.Reads(VLLMGeneration, ("sync_weights", "_fix_param_name_to_vllm")),
        hosts.Calls(VLLMGeneration, "_fix_param_name_to_vllm", 1),
    ),
)
hosts.check(RELIES_ON)
