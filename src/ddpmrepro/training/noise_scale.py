"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

For per-example gradients g_i with mean G and covariance Σ, the mean of B of them has
E|g_B|² = |G|² + tr(Σ)/B. Two batch sizes b < B that the training already has give unbiased
estimates of both terms (their appendix A):

    tr(Σ) ≈ (|g_b|² - |g_B|²) / (1/b - 1/B)        |G|² ≈ |g_B|² - tr(Σ)/B

and B_simple = tr(Σ)/|G|², their estimate of the critical batch size: the batch above which a
larger batch buys little more progress per example. Each estimate of one step is very noisy
(the |G|² one is often negative: the noise can be 90% of |g_B|²), so both are averaged over steps
before dividing, never the ratio; and |G|² must be the noise-corrected one: with |g_B|² in the
denominator, B_simple can never exceed about B.

`NoiseScale` measures it at every step at almost no cost where the step already has two batch
sizes: each microbatch's gradient (train.grad_accum >= 2) and each rank's local gradient (DDP) are
small batches, caught by tensor hooks on the parameters before they are accumulated or
all-reduced; the step's all-reduced gradient is the big one (its norm is the clipping's). With
one process and no accumulation there is only one batch: then the noise-level instrument
(`noise_levels.py`) measures it on its steps from two halves of the batch. `introspect.noise_scale:
false` turns both off: no gns_* value in the log or the steps table.

Cost on a step that records nothing: a Python hook per parameter per microbatch (under a
microsecond each), one fused norm of the gradients per microbatch, and a copy of the first
microbatch's gradients (the hook's reference keeps autograd from handing the buffer to `.grad`):
about 3 ms a step on `tiny` at 2 microbatches of 64, under 2% (docs/INTROSPECTION.md, Cost).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..runtime import distributed as D


def two_batch_estimates(big_sq: float, n_big: float, small: list[tuple[float, float]]) -> tuple[float, float]:
    """Unbiased (|G|², tr(Σ)) from the squared norm of a mean gradient over `n_big` examples and those
    of smaller means (squared norm, examples) of the same distribution (subsets or not).

    Each small mean gives tr(Σ) ≈ (|g_n|² - |g_B|²) / (1/n - 1/B), unbiased for its own n; their
    average is too, whatever the sizes. NaN where no small batch is smaller than the big one."""
    terms = [(sq - big_sq) / (1.0 / n - 1.0 / n_big) for sq, n in small if 0 < n < n_big]
    if not terms or not n_big:
        return math.nan, math.nan
    trace = sum(terms) / len(terms)
    return big_sq - trace / n_big, trace


class SmoothedRatio:
    """B_simple = tr(Σ)/|G|² from exponential averages of both (bias-corrected as Adam's moments),
    updated once per measured log window with a decay for the steps since the last update: a
    half-life in steps, not in log lines nor in measurements (with one process and no accumulation
    the noise scale is measured on recorded steps only, every 250 steps by default, and a decay for
    a log window's 25 steps made the half-life ten times the one asked for). Checkpointed, so a
    resumed run logs the same values."""

    def __init__(self, halflife_steps: float):
        self.halflife = halflife_steps
        self.g2 = self.trace = self.weight = 0.0
        self.step = 0  # of the last update

    def update(self, g2: float, trace: float, step: int) -> float:
        """The window's mean estimates, measured up to `step` (completed updates)."""
        if not (math.isfinite(g2) and math.isfinite(trace)):
            return self.value()
        decay = 0.5 ** ((step - self.step) / self.halflife)
        self.g2 = decay * self.g2 + (1 - decay) * g2
        self.trace = decay * self.trace + (1 - decay) * trace
        self.weight = decay * self.weight + (1 - decay)
        self.step = step
        return self.value()

    def value(self) -> float:
        """tr(Σ)/|G|² of the averages (the bias corrections cancel in the ratio); NaN before any
        measurement, and while the averaged |G|² is not positive (the noise still hides the signal)."""
        if not self.weight or self.g2 <= 0:
            return math.nan
        return self.trace / self.g2

    def averages(self) -> tuple[float, float]:
        return (self.g2 / self.weight, self.trace / self.weight) if self.weight else (math.nan, math.nan)

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "weight": self.weight, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.trace, self.weight = float(state["g2"]), float(state["trace"]), float(state["weight"])
        self.step = int(state["step"])


class NoiseScale:
    """The every-step noise scale from the microbatches and ranks of a step (see the module doc).

    The loop calls `microbatch_sums()` right after each microbatch's backward and hands the result
    to `after_backward(sums, grad_multiplier)` (the factor
    that turns the hooked gradients into the gradient of that microbatch's mean loss: the loss
    scale and 1/grad_accum undone) and `after_step(stats, total_norm)` once the step's gradient is
    all-reduced and unscaled. The sums go into the log's `RunningStats` (reduced over ranks at log
    steps); `log_values` turns a window's means into the estimates.
    """

    def __init__(self, raw_model: torch.nn.Module, *, enabled: bool, micro_batch: int, grad_accum: int, world: int,
                 halflife_steps: float):
        self.n_small, self.n_big = micro_batch, micro_batch * grad_accum * world
        # `introspect.noise_scale`: off means no gns_* anywhere, not even from the buckets' halves.
        self.requested = enabled
        # One batch per step: nothing to compare with (the noise-level instrument's halves measure it then).
        self.enabled = enabled and grad_accum * world >= 2
        self.smoothed = SmoothedRatio(halflife_steps)
        self._grads: list[torch.Tensor] = []
        self._paused = False
        self._step_small = []  # this step's microbatch |g|², kept on the device
        self._handles = [p.register_hook(self._catch) for p in raw_model.parameters() if p.requires_grad] \
            if self.enabled else []

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # the hooks go with the run (the model may outlive it)
        self.close()

    def _catch(self, grad: torch.Tensor) -> None:
        # Before accumulation into .grad and before DDP's all-reduce: this microbatch's, this rank's.
        if not self._paused:
            self._grads.append(grad)

    @contextlib.contextmanager
    def paused(self):
        """Backward passes that are not the training's (the noise-level instrument's) are not caught."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @torch.no_grad()
    def microbatch_sums(self) -> dict[str, torch.Tensor]:
        """Right after a microbatch's backward: the squared norm of the gradient the hooks caught
        ({} when off). Device work only, so a CUDA graph can replay it (train.cuda_graphs)."""
        if not self._grads:
            return {}
        norms = torch._foreach_norm(self._grads)  # one fused pass; the list is dropped right after
        self._grads = []
        return {"gns_micro_sq": torch.stack(norms).double().square().sum()}

    def after_backward(self, sums: dict[str, torch.Tensor], grad_multiplier: float) -> None:
        """Keeps `microbatch_sums`' value as the microbatch's mean-loss gradient (`grad_multiplier`)."""
        if "gns_micro_sq" in sums:
            self._step_small.append(sums["gns_micro_sq"] * grad_multiplier ** 2)

    @torch.no_grad()
    def after_step(self, stats, total_norm: torch.Tensor, *, recorded: bool = False) -> tuple[float, float]:
        """Reports this step's small and big squared norms to `stats` (non-finite ones, as on an fp16
        overflow step, left out; no host sync). On recorded steps also returns this step's own
        (|G|², tr(Σ)) over every rank, for the steps table (a collective: every rank calls it)."""
        if not self.enabled:
            return math.nan, math.nan
        small = torch.stack(self._step_small)
        self._step_small = []
        big = total_norm.detach().double().square()[None]
        stats.report("gns_small_sq", small, torch.isfinite(small))
        stats.report("gns_big_sq", big, torch.isfinite(big))
        if not recorded:
            return math.nan, math.nan
        summed = torch.stack([small.sum(), torch.tensor(float(len(small)), dtype=small.dtype, device=small.device)])
        D.all_reduce_sum_(summed)
        mean_small = float(summed[0] / summed[1])
        return two_batch_estimates(float(big), self.n_big, [(mean_small, self.n_small)])

    def measured(self, g2: float, trace: float, step: int) -> None:
        """A recorded step's own estimate from the noise-level instrument's halves, where a step has
        one batch: into the smoothed averages at the step it was measured, so that it weighs by the
        steps since the previous measurement. (Updated at the end of its log window, the untrained
        step 1 weighed 25 steps, not 1, and made up 91% of the averaged |G|² at the default run's
        end: B_simple 41.5 where the documented rule gives 314. Found from outside, recomputed from
        the steps table.)"""
        if self.requested and not self.enabled:
            self.smoothed.update(g2, trace, step)

    def log_values(self, means: dict, step: int) -> dict:
        """The log line's `gns_*` values from the means of the window that ends at `step` (`means`
        loses the raw sums): the window's average |G|² and tr(Σ) (their per-step estimates are
        linear in the sums, so this is the mean of the per-step estimates) and B_simple from their
        smoothed averages (updated here with the window's means, each standing for the window's
        steps; with one batch a step, at each measurement by `measured`)."""
        small, big = means.pop("gns_small_sq", math.nan), means.pop("gns_big_sq", math.nan)
        step_g2, step_trace = means.pop("gns_g2", math.nan), means.pop("gns_trace", math.nan)
        if not self.requested:
            return {}
        if self.enabled:
            g2, trace = two_batch_estimates(big, self.n_big, [(small, self.n_small)])
        else:  # measured on recorded steps only (the noise-level instrument's halves), if at all
            g2, trace = step_g2, step_trace
        if not (math.isfinite(g2) and math.isfinite(trace)):
            return {}
        b_simple = self.smoothed.update(g2, trace, step) if self.enabled else self.smoothed.value()
        return {"gns_g2": g2, "gns_trace": trace, "gns_b_simple": b_simple}

    def state_dict(self) -> dict:
        return self.smoothed.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.smoothed.load_state_dict(state)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
