"""Post-hoc EMA's tracking side: the power-function EMAs and their snapshots (EDM2, section 3).

The loop holds one `PowerEMA` and calls `update()` where it updates the fixed-rate EMA (after every
step that moved the weights: a skipped step is no update, so the update count n that sets the
decay counts the weights that exist), and `snapshot(step, ...)` on rank 0 after every step. At
`count` evenly spaced steps, the last one the last step, each tracked average is written to
`<run dir>/phema/` as a safetensors file whose metadata say what it is
(`model_dir.snapshot_metadata`), in `train.posthoc_ema_dtype` (the averages themselves stay fp32:
only the stored copy is rounded), and its sha256 goes into the directory's `SHA256SUMS`
(`model_dir.add_to_manifest`); the model directory gets hard links to them, and the sample stage
combines them into the average of another length (`model_dir.reconstruct`).

The snapshots are written when made, into the run directory, and never rewritten except by the
same step of the same run (same bits): a run killed and resumed from an earlier checkpoint
redoes those steps and writes the same files again, so every snapshot survives, bitwise. Every
write is a new file renamed into place (`files.atomic_write`), never a write into the old one, so
the model directory's hard link to a snapshot never sees it change.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .. import files
from ..model.phema import decay, gamma_of
from ..model_dir import add_to_manifest, snapshot_file, snapshot_metadata, snapshot_steps

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # train.posthoc_ema_dtype
log = logging.getLogger(__name__)
from .ema import EmaUpdater, init_ema


class PowerEMA:
    """The power-function EMAs of `model` (the raw module), one per relative standard deviation
    in `sigmas` ([] tracks nothing and writes nothing); `count` snapshots over `steps` steps, stored
    as `dtype` (a `train.posthoc_ema_dtype`)."""

    def __init__(self, model: nn.Module, sigmas, *, count: int, steps: int, dtype: str = "fp32"):
        self.model = model
        self.dtype = DTYPES[dtype]
        self.snapshot_steps = set(snapshot_steps(steps, count))
        self.gammas = {float(s): gamma_of(float(s)) for s in sigmas}
        self.num_updates = 0
        self._set({s: init_ema(model) for s in self.gammas})

    def _set(self, averages: dict[float, dict]) -> None:
        self.averages = averages
        self._updaters = {s: EmaUpdater(avg, self.model) for s, avg in averages.items()}

    def update(self) -> None:
        """One update after an optimizer step that changed the weights."""
        self.num_updates += 1
        for s, update in self._updaters.items():
            update(decay(self.gammas[s], self.num_updates))

    def snapshot(self, step: int, directory: Path, *, run_hash: str) -> None:
        """Writes the averages after `step` (completed steps) if a snapshot falls there (rank 0)."""
        if not self.averages or step not in self.snapshot_steps:
            return
        directory.mkdir(parents=True, exist_ok=True)
        digests = {}
        for s, avg in self.averages.items():
            meta = snapshot_metadata(sigma_rel=s, step=step, updates=self.num_updates, run_hash=run_hash)
            path = directory / snapshot_file(step, s)
            files.save_weights(self._stored(avg, path.name), path, metadata=meta)
            digests[path.name] = files.sha256(path)  # just written: read back from the page cache
        # After the files: a kill between leaves a snapshot without its sum, and the checkpoint of
        # this step unwritten, so the resumed run writes both again.
        add_to_manifest(directory, digests)

    def _stored(self, avg: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
        """The average as the file stores it: its floating tensors rounded to the snapshot dtype, but
        for a tensor fp16 cannot hold (a value beyond 65504 would become inf), which stays fp32."""
        out = {}
        for k, v in avg.items():
            rounded = v.to(self.dtype) if v.is_floating_point() else v
            if rounded.is_floating_point() and not torch.isfinite(rounded).all() and torch.isfinite(v).all():
                log.warning("%s: %s exceeds %s's range; stored in fp32", name, k, self.dtype)
                rounded = v
            out[k] = rounded
        return out

    def state_dict(self) -> dict:
        return {"averages": {repr(s): avg for s, avg in self.averages.items()}, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        averages = {float(s): avg for s, avg in state["averages"].items()}
        if set(averages) != set(self.averages):
            raise ValueError(f"the checkpoint tracks post-hoc EMA lengths {sorted(averages)}, this run "
                             f"{sorted(self.averages)}")
        self._set(averages)
        self.num_updates = int(state["num_updates"])
