"""The step's agreement as data ([Note: the step's agreement], below): AgreementLayout, where each flag
and counter sits in phase 2's one all_reduce(MAX) message, and Agreed, what the ranks agreed on. Pure
Python, so the estimator (zerofast/estimate/traffic.py) counts the message's bytes from the same layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# [Note: the step's agreement]
# Phase 2's one small all_reduce(MAX) carries, besides which parameters got a gradient, this rank's
# step count, micro-batch count and running hashes of the buckets it reduced and gathered this step,
# in order (each also negated, so the MAX yields both the largest and the smallest), and a failure
# flag; AgreementLayout says where each sits in the message. Ranks whose counts differ raise
# OutOfStepError on every rank, before anything is applied: a rank that ran an extra micro-batch or
# skipped one (stage 1, whose extra micro-batches communicate nothing), or (stage 3) ran its modules
# in another order, so that gathers paired up with the wrong buckets of the same size, a silent mix
# of data that only this check sees. Where the collectives themselves no longer pair up (stages 2
# and 3: an extra micro-batch issues extra reduces), the mismatch may first surface as a
# CollectiveError or a hang up to the timeout; check_collectives (ZEROFAST_DEBUG=1) catches it
# before the first differing collective is issued. The failure flag makes the update
# all-or-nothing: the last checks before it (the hyper-parameters of every group, as an lr
# scheduler may have left them) run on every rank before the agreement; if any rank's fail, every
# rank raises and applies nothing, the parameters and optimizer state stay those of the previous
# step everywhere, and the step's gradients are dropped. After the agreement, phase 3 is
# elementwise kernels over memory that already exists, and phase 4 (stages 1 and 2) only moves the
# updated owned ranges, which a checkpoint reads from their owners.


@dataclass(frozen=True)
class AgreementLayout:
    """The int64 message of the step's agreement, all_reduced with MAX: `params` flags (the
    parameter got a gradient on this rank), then each counter of COUNTERS as two entries, its value
    and its negation, then the failure flag (0, or 1 + the rank that failed before the update)."""

    params: int
    COUNTERS: ClassVar[tuple[str, ...]] = ("steps", "micro_batches", "reduces", "gathers")

    @property
    def used(self) -> slice:
        return slice(0, self.params)

    def counter(self, name: str) -> slice:
        start = self.params + 2 * self.COUNTERS.index(name)
        return slice(start, start + 2)

    @property
    def failed(self) -> int:
        return self.params + 2 * len(self.COUNTERS)

    @property
    def numel(self) -> int:
        return self.failed + 1

    def pack(self, used: list[bool], counts: dict[str, int], failed_rank: int | None) -> list[int]:
        """This rank's message: counts holds a value for every name of COUNTERS."""
        message = [0] * self.numel
        message[self.used] = [int(u) for u in used]
        for name in self.COUNTERS:
            message[self.counter(name)] = [counts[name], -counts[name]]
        message[self.failed] = 0 if failed_rank is None else failed_rank + 1
        return message

    def read(self, agreed: list[int]) -> Agreed:
        """The message after the all_reduce(MAX)."""
        ranges = {}
        for name in self.COUNTERS:
            largest, negated_smallest = agreed[self.counter(name)]
            ranges[name] = (-negated_smallest, largest)
        failed = agreed[self.failed]
        return Agreed([bool(x) for x in agreed[self.used]], ranges, None if failed == 0 else failed - 1)


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on: AgreementLayout.read."""

    used: list[bool]  # the parameter got a gradient on some rank
    ranges: dict[str, tuple[int, int]]  # each counter's (smallest, largest) over the ranks
    failed_rank: int | None  # a rank that failed before the update (the highest), or None

    def same(self, name: str) -> bool:
        smallest, largest = self.ranges[name]
        return smallest == largest
