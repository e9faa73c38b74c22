"""What a NaN or inf gradient does to an optimizer step.

fp16 (the GradScaler): the scaler skips the step and lowers the loss scale; that is routine
(the scale searches for the largest that does not overflow) and counted as a skipped step.
fp32/bf16: `train.on_nonfinite` decides. `skip` skips the update exactly (AdamW's moments and step
count, the EMAs and their warmup count untouched) and counts it; `error` stops the run before
anything after the bad step is logged or saved, so a poisoned model is never written.
"""
from __future__ import annotations

import logging

import torch

from ..runtime import distributed as D

log = logging.getLogger(__name__)


class NonfiniteSteps:
    """`step(...)` runs the optimizer step under that policy and says whether it was skipped;
    `check(...)` raises before a log or a checkpoint if an `error`-policy run met a bad step."""

    def __init__(self, policy: str, precision: str, scaler: torch.amp.GradScaler, device: torch.device):
        self.policy, self.precision, self.scaler = policy, precision, scaler
        self.skipped_steps = 0
        # The first step whose gradient norm was NaN/inf (0: none), noted on the device without a sync.
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)

    def step(self, opt: torch.optim.Optimizer, total_norm: torch.Tensor, step: int, loss_scale: float) -> bool:
        scaler = self.scaler
        skipped = False
        if not scaler.is_enabled() and self.policy == "skip":
            # One host sync per step: an exact skip must be decided before stepping, and masking AdamW
            # on the device would copy its whole state every step. The fp16 GradScaler syncs here too.
            skipped = not bool(torch.isfinite(total_norm))
        elif not scaler.is_enabled():
            # No sync: note the first bad step on the device; `check` reads it before anything is
            # logged or saved.
            self.first_bad = torch.where(torch.isfinite(total_norm) | (self.first_bad > 0), self.first_bad, step + 1)
        if not skipped:
            scaler.step(opt)
        scaler.update()
        skipped = skipped or (scaler.is_enabled() and scaler.get_scale() < loss_scale)
        if skipped:
            self.skipped_steps += 1
            if not scaler.is_enabled() and D.is_main():  # fp16's skips are routine: not worth a warning
                log.warning("step %d: non-finite gradient norm under %s; update skipped (%d so far)",
                            step + 1, self.precision, self.skipped_steps)
        return skipped

    def check(self, saved_step: int) -> None:
        """Raises if a bad step was met under `error` (the same on every rank: the gradients are all-reduced)."""
        bad = int(self.first_bad)
        if bad > 0:
            raise FloatingPointError(
                f"non-finite gradient norm at step {bad} under {self.precision}; stopped without saving past step "
                f"{saved_step}. Lower train.lr, or set train.on_nonfinite: skip, and rerun to resume")

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state["skipped_steps"])
