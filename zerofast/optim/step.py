"""Stepper: the order in which a step calls its parts, in one place (each phase's owner: zero_adam.py).

    step()
      rest      the last step's gathers finished; stage 3: no unit stays gathered across the update
      phase 2   the reduces waited for, the ranks' agreement, overflow and norm (GradReducer.prepare);
                clipping folded into the kernel's grad_scale
      commit    the replication's decision (fixed replicas: always; torchft's: [Note: replica groups
                on torchft]); no: nothing applied, this step's gradients dropped
      flush     the last step's delayed update, if one is in flight ([Note: the delayed update])
      phase 3   the rule's update over the shard (offloaded: through zerofast/offload/update.py, all
                or none across ranks)
      phase 4   stages 1 and 2: the updated parameters gathered (stage 3: the next forward gathers)
      end       the loss scale updated, the step's traffic kept for report(), the next step begun

Whatever reads the state whole first brings it to rest (quiesce: gathers finished, units released,
the delayed update applied) and, for a checkpoint, has the master take what the model was given
(quiesce_state). Stepper is also the offloaded step's StepSide: the ranks' agreement on a write, and
what a step not applied leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .builder import Parts


class Stepper:
    """The order of a step over the parts build() wired (zerofast/optim/builder.py), and the state at
    rest between steps. check_update: the front's last checks before an update, run in phase 2."""

    def __init__(self, parts: Parts, check_update: Callable[[], None]):
        self.parts, self.check_update = parts, check_update
        self.skipped = False  # the last step() applied nothing (fp16 overflow, or not committed)
        self.last_comm: dict[str, int] = {}  # the last step's payload bytes per collective
        self.decided = False  # this step's commit decision was taken ([Note: replica groups on torchft])

    def step(self, param_groups: list[dict]) -> None:
        parts, plan = self.parts, self.parts.plan
        self.decided = False
        if parts.grads.phase.in_no_sync:
            raise RuntimeError(
                f"{plan.front}.step() was called inside `with opt.no_sync():`; no_sync() wraps the micro-batches "
                "whose gradients are only accumulated, and step() follows the last backward, outside it"
            )
        where, world = parts.comm.where, parts.divisor()
        where.phase = "step() (phase 2: the reduces and the agreement)"
        self.quiesce(flush=False)  # the flush comes after phase 2: [Note: the delayed update]
        prep = parts.grads.prepare(plan.max_grad_norm is not None, world, check=self.check_update)
        if plan.max_grad_norm is not None:
            parts.grads.clip(prep, plan.max_grad_norm)
        if not self.commit():
            return
        self.flush()
        anything = any(prep.used)  # agreed: the same on every rank
        if anything and not prep.found_inf:
            self.apply(prep.used, param_groups, prep.grad_scale(world, parts.scaler.scale))  # phase 3
            if plan.gather_after_step and not plan.offload.delayed_update:  # phase 4 (delayed: the next flush)
                where.phase = "step() (phase 4: the parameter gather)"
                with torch.profiler.record_function("zerofast::gather"):
                    parts.gather.start()
                    if not plan.overlap_param_gather:
                        parts.gather.wait()
        if anything:  # a step without gradients anywhere is no evidence for or against the scale
            parts.scaler.update(prep.found_inf)
        self.skipped = prep.found_inf
        self.end()

    def commit(self) -> bool:
        """The replication's decision; no: nothing applied or counted, the step's gradients dropped."""
        self.decided = True  # before it: a commit that raises is this step's decision too
        if self.parts.topology.replication.commit():
            return True
        self.skipped = True
        self.end(counted=False)
        return False

    def end(self, counted: bool = True) -> None:
        """The step's payload bytes per collective kept (the frozen parameters' gathers counted in:
        [Note: frozen parameters in stage 3]), the counts restarted, the next step begun."""
        parts = self.parts
        stats = dict(parts.comm.stats)
        if parts.frozen_comm is not None:
            for name, nbytes in parts.frozen_comm.stats.items():
                stats[name] = stats.get(name, 0) + nbytes
            parts.frozen_comm.new_step()
        self.last_comm = stats
        if counted:
            parts.comm.where.step += 1
        parts.comm.where.phase = "forward"
        parts.grads.begin_step()

    def apply(self, used: list[bool], param_groups: list[dict], grad_scale) -> None:
        """Phase 3: the rule's update over the shard; offloaded, with what makes it all or none."""
        parts = self.parts
        try:
            if parts.offload is None:
                parts.update(used, param_groups, grad_scale)
            else:
                parts.offload.apply(lambda: parts.update(used, param_groups, grad_scale), self)
        finally:
            parts.shard.let_go()  # stage 3's shards in files: what the update touched leaves memory

    # --- the state at rest ------------------------------------------------------------------------------

    def quiesce(self, flush: bool = True) -> None:
        """Bring the state to rest: parameter gathers in flight waited for (stages 1 and 2: the last
        step's, if some module never ran), every unit released (stage 3), the delayed update applied."""
        parts = self.parts
        parts.gather.wait()
        if parts.plan.params_sharded:
            parts.units.release_all()
        if flush:
            self.flush()  # once no unit is gathered

    def quiesce_state(self) -> None:
        """quiesce(), and the fp32 master taking what was written into the model since the last step:
        the state at rest as a checkpoint reads it."""
        self.quiesce()
        offload = self.parts.offload
        (offload or self.parts.shard).follow_params()

    def flush(self) -> None:
        """The delayed update in flight, if any, applied on every rank (zerofast/offload/update.py);
        stages 1 and 2 then gather the updated parameters. Collective while one is in flight."""
        parts = self.parts
        if parts.offload is not None and parts.offload.flush(self) and not parts.plan.params_sharded:
            parts.gather.start()
            parts.gather.wait()

    def sync_params_from_master(self) -> None:
        """After the fp32 master was written outside step(): the low-precision parameters become its
        rounding; stages 1 and 2 gather every rank's full parameters from their owners."""
        parts = self.parts
        parts.shard.sync_params_from_master()
        if parts.offload is not None:
            parts.offload.params_written()
        if not parts.plan.params_sharded:
            parts.gather.start()
            parts.gather.wait()

    # --- zerofast.offload.update.StepSide ----------------------------------------------------------------

    def agree(self, this_failed: bool, what: str, everyone: bool) -> int:
        parts = self.parts
        tp, pp = parts.topology.tp_group, parts.topology.pp_group
        # With tensor or pipeline parallelism the ranks agree over "tp" and "pp" too (a step applied on
        # some of the model's parts only would leave it split across two steps) and name a rank by its
        # global rank.
        failed = -1 if not this_failed else (parts.topology.rank if tp is None and pp is None else dist.get_rank())
        if not everyone:
            return failed
        parts.comm.where.phase = "step() (phase 3: the agreement that every rank wrote its offloaded state)"
        flag = torch.tensor([failed + 1], dtype=torch.int64).to(parts.comm.device)
        parts.comm.all_reduce_max(flag)
        if tp is not None:
            parts.comm.all_reduce_tp(flag, dist.ReduceOp.MAX, tp, "flags", "the offloaded write's agreement over tp")
        if pp is not None:
            parts.comm.all_reduce_tp(
                flag, dist.ReduceOp.MAX, pp, "flags", "the offloaded write's agreement over pp", "pp"
            )
        return int(flag.item()) - 1

    def not_applied(self, what: str, failed: int) -> str:
        parts = self.parts
        where = parts.comm.where
        parts.grads.begin_step()  # this step's gradients are dropped; nothing was applied
        where.phase = "forward"
        return (
            f"{parts.plan.front}: {what} (step {where.step + 1}) was not applied on any rank: rank {failed} could "
            f"not write its offloaded state; parameters and optimizer state are those after step {where.step} on "
            f"every rank, and this step's gradients are dropped"
        )
