"""Introspection as the loop sees it: on recorded steps, parameter-gradient norms and hooked
activation gradients go into the tables, and on some of them (`introspect.noise_levels_every`) the
gradients by noise level; on the other steps nothing is measured at all.

The loop calls it at four points of a step: `begin` (arms the activation hooks), `measure` after
each microbatch's forward (the noise-level buckets' extra backward passes), `capture` (after the
gradients are all-reduced and unscaled, before clipping scales them in place) and `end` (collects
over ranks, hands the rows to the table writer on rank 0).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..params import IntrospectParams, ParamsError, levels_measured_at
from ..runtime import distributed as D
from . import introspect
from .noise_levels import NoiseLevelGradients, bucket_layout
from .noise_scale import NoiseScale


def gradient_recorders(raw_model: torch.nn.Module, ip: IntrospectParams):
    """(the parameter-gradient recorder, the activation-gradient recorder) of `ip`'s patterns, hooks
    attached; a pattern that matches nothing is a one-line `ParamsError` (check_params builds them on
    the model on the `meta` device to refuse it before any stage runs)."""
    try:
        grads = introspect.ParamGradRecorder(raw_model.named_parameters(), ip.params, update_ratio=ip.update_ratio)
    except ValueError as e:
        raise ParamsError(f"introspect.params: {e}") from None
    # Each pattern list checked here, so that the line names the key that holds the pattern.
    modules = [name for name, _ in raw_model.named_modules() if name]
    try:
        watched = introspect.select_names(modules, ip.modules, outermost=True, what="module") if ip.modules else []
    except ValueError as e:
        raise ParamsError(f"introspect.modules: {e}") from None
    try:
        dumped = introspect.select_names(modules, ip.dump_modules, outermost=True, what="module") \
            if ip.dump_modules else []
    except ValueError as e:
        raise ParamsError(f"introspect.dump_modules: {e}") from None
    if not set(dumped) <= set(watched):
        raise ParamsError(f"introspect.dump_modules: {sorted(set(dumped) - set(watched))} are not among the modules "
                          "introspect.modules records (its outermost matches); add them to its patterns")
    activations = introspect.ActivationGradRecorder(
        raw_model, ip.modules, histogram_bins=ip.histogram_bins, dump_steps=ip.dump_steps,
        dump_modules=ip.dump_modules, dump_max_mb=ip.dump_max_mb, reduction="global")
    return grads, activations


class Introspection:
    """The gradient recorders and the table writer of one run (the writer on rank 0 only).

    The recorders' patterns are checked against the model when this is built, before anything
    is written, and a pattern that matches nothing is a one-line `ParamsError`."""

    def __init__(self, raw_model: torch.nn.Module, ip: IntrospectParams, *, last_step: int, alphas_cumprod,
                 batch_per_step: int, noise_scale: NoiseScale, stats, device: torch.device):
        self.every, self.steps, self.last_step = ip.every, [*ip.steps, *ip.dump_steps], last_step
        # The buckets' extra backward passes on a sparser cadence of their own (docs/INTROSPECTION.md, Cost).
        self.ip = ip
        self.noise_scale, self.stats = noise_scale, stats
        on = bucket_layout(alphas_cumprod, ip, batch_per_step) is not None
        self.levels = NoiseLevelGradients(raw_model, alphas_cumprod, ip, batch_per_step=batch_per_step,
                                          device=device) if on else None
        self.main = D.is_main()
        self.grads, self.activations = gradient_recorders(raw_model, ip)
        self.writer = None
        self._unflushed_from = None  # from a checkpoint (load_state_dict), for the writer
        self.recording = self.measuring_levels = False

    @property
    def hooked_modules(self) -> set[str]:
        """The modules whose activation gradients are hooked (compilation leaves them eager)."""
        return set(self.activations.names)

    def open_tables(self, tables_dir: Path, start_step: int) -> None:
        """The table writer (rank 0), once the step to start from is known: a resumed run's writer
        first drops the rows written after its checkpoint, and reads back its snapshot's."""
        if self.main:
            self.writer = introspect.TableWriter(tables_dir, start_step=start_step, unflushed_from=self._unflushed_from)

    def state_dict(self) -> dict:
        """The checkpoint's: from which step the tables' rows on disk are a snapshot (TableWriter)."""
        return {"unflushed_from": self.writer.unflushed_from if self.writer is not None else 0}

    def load_state_dict(self, state: dict) -> None:
        self._unflushed_from = int(state["unflushed_from"])

    def __enter__(self):  # the activation hooks, removed on exit
        self.activations.__enter__()
        return self

    def __exit__(self, *exc):
        self.activations.__exit__(*exc)

    def begin(self, done: int, loss_scale: float) -> bool:
        """Before the forward passes of update `done`: whether it is recorded (then the hooks are armed;
        the activation gradients they catch are divided by the loss scale)."""
        self.recording = introspect.is_record_step(done, self.every, self.steps, last=self.last_step)
        # The noise-level buckets: on the recorded steps of their own cadence, `steps` and the last.
        self.measuring_levels = self.levels is not None and levels_measured_at(done, self.ip, last=self.last_step)
        if self.recording:
            self.activations.arm(done, loss_scale=loss_scale)
        return self.recording

    def measure(self, weighted_losses: torch.Tensor, t: torch.Tensor, *, grad_multiplier: float,
                loss_scale: float) -> None:
        """On the buckets' steps, the noise-level buckets' parts of this microbatch's gradient (extra
        backward passes through its graph, which neither the hooks nor the noise scale count)."""
        if self.measuring_levels:
            with self.activations.paused(), self.noise_scale.paused():
                self.levels.measure(weighted_losses, t,
                                    grad_multiplier=grad_multiplier, loss_scale=loss_scale, batch=len(t))

    def capture(self, done: int) -> None:
        """The parameter gradients as the optimizer will see them, before clipping."""
        if self.recording and self.main:
            self.grads.capture(done)

    def end(self, done: int, gns_step: tuple[float, float], **step_values) -> list[dict]:
        """After the update: the recorded rows into the tables (`gns_step`: the noise scale's own
        estimate of this step, NaN where it has none; `step_values`: total_norm, clip_threshold,
        skipped, loss_scale, lr, for the steps table). A collective on recorded steps: every rank calls it.
        Returns this step's noise-level rows, the same on every rank ([] where none were measured)."""
        if not self.recording:
            return []
        act_rows = self.activations.collect()
        level_rows, halves = self.levels.finish() if self.measuring_levels else ([], (math.nan, math.nan))
        if not self.noise_scale.requested:  # introspect.noise_scale: false: no gns_* from the halves either
            halves = (math.nan, math.nan)
        if not self.noise_scale.enabled and all(map(math.isfinite, halves)):
            # one batch per step: the noise scale comes from the halves of the recorded steps
            self.stats.report("gns_g2", torch.tensor([halves[0]], dtype=torch.float64))
            self.stats.report("gns_trace", torch.tensor([halves[1]], dtype=torch.float64))
            self.noise_scale.measured(*halves, step=done)
        g2, trace = gns_step if all(map(math.isfinite, gns_step)) else halves
        if self.main:
            param_rows, step_row = self.grads.finish(**step_values)
            step_row.update(gns_g2=g2, gns_trace=trace)
            self.writer.add(done, params=param_rows, summary=step_row, activations=act_rows,
                            noise_levels=[{"step": done, **r} for r in level_rows],
                            dumps=self.activations.take_dumps())
        return level_rows

    def add_rows(self, done: int, **tables: list[dict]) -> None:
        """Rows the loop measures itself (e.g. `loss_weight`), into the tables on rank 0; empty ones skipped."""
        tables = {name: rows for name, rows in tables.items() if rows}
        if self.writer is not None and tables:
            self.writer.add(done, **tables)

    def snapshot_tables(self) -> None:
        """The rows so far onto disk, before a checkpoint (a resume drops the rows after its
        checkpoint): `TableWriter.snapshot`, which leaves the tables' files as a run without
        checkpoints writes them."""
        if self.writer is not None:
            self.writer.snapshot()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
