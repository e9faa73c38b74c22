"""Timestep samplers: uniform, IDDPM's loss-second-moment importance sampler, and one from the
gradients themselves.

A sampler draws `t` with probabilities `p_t` and returns the weights `1 / (T p_t)` that make
the weighted loss an unbiased estimate of the uniform-t loss: E_p[w_t L_t] = mean_t L_t, and
the weighted gradient one of the uniform-t gradient.
The importance sampler keeps the last `history` losses of every timestep, stays uniform
until every timestep has a full history, then uses p_t ∝ sqrt(E[L_t^2]) mixed with a small
uniform share (Nichol & Dhariwal 2021, Sec. 3.3). Under DDP the losses of all ranks are
all-gathered before `update`, so every rank holds the identical history and draws with the
same weights.

E[L_t^2] stands in for what the variance of the gradient estimate depends on: an unbiased
estimate w_t ∇L_t(x) with t ~ p has second moment sum_t E‖∇L_t‖² / (T² p_t), least for
p_t ∝ sqrt(E_x‖∇θ L_t(x)‖²) (the Cauchy-Schwarz bound; Alain et al. 2015 for examples,
here for noise levels). Two samplers draw by it:
- `GradNormSampler` (`grad-norm`): the introspection's noise-level buckets (`noise_levels.py`)
  measure, on its steps, each bucket's mean gradient and its covariance's trace from two halves,
  whose sum is the bucket's E‖w ∇L‖² of the whole network (`update_levels`); IDDPM's loss history
  spreads each bucket's measurement over its t (E‖∇L_t‖² = r_b E[L_t²]);
- `OutputGradNormSampler` (`output-grad-norm`), per t on every step: IDDPM's history of the last
  10 values per t, of each example's gradient norm of the output layer (output_grads.py) in place
  of its loss. The last layer stands in for the network; per t and on every step.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..params import SAMPLER_HISTORY, ParamsError, levels_measured_at
from .batches import timestep_uniforms
from .output_grads import OutputGradNorms


class UniformSampler:
    # what `update(t, values)` learns from, per example: "losses", "output_grads" (the output layer's
    # gradient norms), or None (nothing: DeferredUpdates gathers and queues nothing)
    learns_from = None

    def __init__(self, num_timesteps: int):
        self.num_timesteps = num_timesteps

    def weights(self) -> np.ndarray:
        return np.ones(self.num_timesteps, dtype=np.float64)

    def sample(self, n: int, generator: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Returns t (n,) int64 and the importance weights (n,) float32."""
        return self.sample_from_uniform(torch.rand(n, generator=generator, dtype=torch.float64), device)

    def sample_from_uniform(self, u: torch.Tensor, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF draw: t_i = min{t : cdf(t) > u_i} for u_i ~ U[0, 1).

        Lets the caller draw u_i from each example's own generator, so an example's timestep
        does not depend on which process or batch it lands in.
        """
        w = self.weights()
        p = torch.from_numpy(w / w.sum())
        cdf = torch.cumsum(p, 0)
        t = torch.searchsorted(cdf, u.double().contiguous(), right=True).clamp(max=len(p) - 1)
        weights = 1.0 / (len(p) * p[t])
        return t.to(device), weights.float().to(device)

    def update(self, t: torch.Tensor, losses: torch.Tensor) -> None:
        pass

    def update_levels(self, rows: list[dict]) -> None:
        """The noise-level buckets' rows of a measured step (`NoiseLevelGradients.finish`); only
        `GradNormSampler` learns from them."""

    def end_note(self, steps: int) -> str | None:
        """A note for the end of a run of `steps` that the sampler did not do what its name says."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LossSecondMomentSampler(UniformSampler):
    name, learns_from = "loss-second-moment", "losses"

    def __init__(self, num_timesteps: int, history: int = SAMPLER_HISTORY, uniform_prob: float = 0.001):
        super().__init__(num_timesteps)
        self.history = history
        self.uniform_prob = uniform_prob
        self.loss_history = np.zeros((num_timesteps, history), dtype=np.float64)
        self.loss_counts = np.zeros(num_timesteps, dtype=np.int64)
        # Whether a draw of this process came after the warm-up (a history full only after the last
        # update drew nothing). Checkpointed: a finished run resumed draws nothing, and said it drew
        # uniformly all along (found from outside).
        self.drew_by_importance = False

    def warmed_up(self) -> bool:
        return bool((self.loss_counts == self.history).all())

    def sample_from_uniform(self, u: torch.Tensor, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        self.drew_by_importance = self.drew_by_importance or self.warmed_up()
        return super().sample_from_uniform(u, device)

    def end_note(self, steps: int) -> str | None:
        if self.drew_by_importance:
            return None
        return (f"note: train.timestep_sampler '{self.name}' drew uniformly all {steps} steps: its history "
                f"({self.history} values at every t) was not full before its last draw; train longer or with a larger batch")

    def second_moments(self) -> np.ndarray:
        """What p_t ∝ sqrt of, per t: E[L_t²] over the history (a subclass's model of E‖∇L_t‖²)."""
        return np.mean(self.loss_history**2, axis=-1)

    def weights(self) -> np.ndarray:
        if not self.warmed_up():
            return np.ones(self.num_timesteps, dtype=np.float64)
        w = np.sqrt(self.second_moments())
        w /= w.sum()
        w *= 1 - self.uniform_prob
        w += self.uniform_prob / len(w)
        return w

    def update(self, t: torch.Tensor, losses: torch.Tensor) -> None:
        """Records per-example losses (unweighted) in the ring buffer of each timestep.

        Call with the losses of *all* ranks (see `gather_for_sampler`), in the same order on
        every rank, so the histories stay identical. A non-finite loss (a step that
        `train.on_nonfinite: skip` or the fp16 scaler skips) is left out: it would make every
        weight NaN.
        """
        for ti, loss in zip(t.tolist(), losses.tolist()):
            if not math.isfinite(loss):
                continue
            if self.loss_counts[ti] == self.history:
                # drop the oldest (a shift keeps the order, so state is deterministic)
                self.loss_history[ti, :-1] = self.loss_history[ti, 1:]
                self.loss_history[ti, -1] = loss
            else:
                self.loss_history[ti, self.loss_counts[ti]] = loss
                self.loss_counts[ti] += 1

    def state_dict(self) -> dict:
        # tensors, not numpy arrays: checkpoints load with weights_only=True
        return {"loss_history": torch.from_numpy(self.loss_history.copy()),
                "loss_counts": torch.from_numpy(self.loss_counts.copy()),
                "drew_by_importance": torch.tensor(self.drew_by_importance)}

    def load_state_dict(self, state: dict) -> None:
        hist = state["loss_history"].numpy()
        if hist.shape != self.loss_history.shape:
            raise ValueError(f"sampler history has shape {tuple(hist.shape)}, expected {self.loss_history.shape}")
        self.loss_history = hist.astype(np.float64).copy()
        self.loss_counts = state["loss_counts"].numpy().astype(np.int64).copy()
        self.drew_by_importance = bool(state["drew_by_importance"])


class OutputGradNormSampler(LossSecondMomentSampler):
    """p_t ∝ sqrt(E‖∇_out L_t‖²): IDDPM's sampler, its history fed each example's gradient norm of
    the output layer (of the unweighted loss) in place of the loss. The same state, warm-up,
    uniform share, DDP gathering and checkpoint entries."""
    name, learns_from = "output-grad-norm", "output_grads"


class GradNormSampler(LossSecondMomentSampler):
    name = "grad-norm"
    """p_t ∝ sqrt(E‖∇θ L_t‖²), modelled as r_b E[L_t²]: IDDPM's history of the last losses per t gives
    the shape within each noise-level bucket b, and the buckets' measured gradients give r_b, the
    bucket's ratio of the gradient's second moment to the loss's. Mixed with a small uniform share;
    uniform until the loss history is full and every bucket has a ratio.

    Why both: the buckets measure the whole network's gradient, but only a few of them, on recorded
    steps, from a few examples each; the losses come for every example on every step, per t, but the
    gradient's second moment per unit of the loss's changes with the noise level (at 400 steps on
    the digits, by 65-120x across t, smoothly: benchmarks/sampler_variance.py). At one model, with
    4 or 8 buckets this came within 0.011-0.022 of the optimum's tr(Σ) (in units of uniform's),
    which one bucket per level gives, where the buckets alone or the loss alone stay 0.05-0.10
    above it (docs/INTROSPECTION.md).

    `update_levels(rows)` takes the bucket rows of a measured step (`NoiseLevelGradients.finish`:
    `g2` = |E g|² and `trace` = tr(Σ) of the bucket's per-example gradients g = w_t ∇L_t, the
    importance weight included). Their sum is E‖g‖² over the bucket's examples, drawn with p_t / P_b:
    under the model, r_b sum_{t in b} E[L_t²] / (P_b T² p_t), with p the weights the step drew with
    (those of `weights()` until this update), so r_b is that sum divided out. Each bucket keeps an
    exponential average over measured steps (half-life `halflife` of them, bias-corrected as Adam's
    moments). A non-positive or non-finite estimate (too few examples: the two-halves estimate is
    unbiased, not positive) leaves that bucket's average as it was. The rows are those of the whole
    global batch, identical on every rank after the buckets' all-reduce, and the losses are gathered
    as IDDPM's sampler gathers them, so the ranks stay in step."""

    def __init__(self, bucket_of_t: np.ndarray, halflife: float = 10.0, uniform_prob: float = 0.001,
                 history: int = SAMPLER_HISTORY):
        super().__init__(len(bucket_of_t), history=history, uniform_prob=uniform_prob)
        self.bucket_of_t = np.asarray(bucket_of_t, dtype=np.int64)
        self.count = int(self.bucket_of_t.max()) + 1
        self.decay = 0.5 ** (1.0 / halflife)
        self.sums = np.zeros(self.count)     # averages' numerators: r_b per bucket
        self.totals = np.zeros(self.count)   # their bias corrections (1 - decay^k)

    def warmed_up(self) -> bool:
        return super().warmed_up() and bool((self.totals > 0).all())

    def end_note(self, steps: int) -> str | None:
        """`check_steers` refuses a schedule that can never leave uniform; a run can
        still end uniform (a non-finite loss left out of the history, which then filled later than
        the check's replay, or a bucket's few examples gave no positive estimate): say so, with the
        advice that fits the cause."""
        if self.warmed_up():
            return None
        if not super().warmed_up():
            why = f"its loss history ({self.history} losses at every t) never filled; train longer or with a larger batch"
        else:
            why = ("no noise-level bucket measurement after its loss history filled gave every bucket a positive "
                   "ratio; measure the buckets later or on more steps (introspect.steps, noise_levels_every), or "
                   "with more examples each (fewer introspect.noise_buckets)")
        return f"note: train.timestep_sampler 'grad-norm' drew uniformly all {steps} steps: {why}"

    def ratios(self) -> np.ndarray:
        """r_b = E‖∇θ L‖² / E[L²] per bucket (NaN where not measured yet)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.totals > 0, self.sums / self.totals, np.nan)

    def second_moments(self) -> np.ndarray:
        """The model's E‖∇θ L_t‖² per t: r_b E[L_t²] (NaN where a bucket has no ratio yet); IDDPM's
        `weights()` draws by it."""
        return self.ratios()[self.bucket_of_t] * super().second_moments()

    def update_levels(self, rows: list[dict]) -> None:
        if not super().warmed_up():
            return  # no loss history to scale yet
        p = self.weights() / self.weights().sum()
        loss_sq = super().second_moments()
        T = self.num_timesteps
        for r in rows:
            b = r["bucket"]
            inside = self.bucket_of_t == b
            per_unit_ratio = float(np.sum(loss_sq[inside] / (T ** 2 * p[inside])) / p[inside].sum())
            ratio = (r["g2"] + r["trace"]) / per_unit_ratio
            if not (math.isfinite(ratio) and ratio > 0):
                continue
            self.sums[b] = self.decay * self.sums[b] + (1 - self.decay) * ratio
            self.totals[b] = self.decay * self.totals[b] + (1 - self.decay)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sums": torch.from_numpy(self.sums.copy()),
                "totals": torch.from_numpy(self.totals.copy())}

    def load_state_dict(self, state: dict) -> None:
        sums, totals = state["sums"].numpy(), state["totals"].numpy()
        if sums.shape != self.sums.shape or totals.shape != self.totals.shape:
            raise ValueError(f"sampler state has {len(sums)} buckets, expected {self.count}")
        super().load_state_dict(state)
        self.sums, self.totals = sums.astype(np.float64).copy(), totals.astype(np.float64).copy()


def steering_step(*, seed: int, timesteps: int, global_batch: int, grad_accum: int, steps: int,
                  history: int = SAMPLER_HISTORY) -> int | None:
    """The first update step whose noise-level measurement `grad-norm` can learn from, found by
    replaying the run's own draws of t (None if not before `steps`): until then it draws uniformly,
    so t depends only on each example's seed (`batches.timestep_uniforms`), not on the network.

    `update_levels` needs a full loss history (`history` losses at every t), and the measurement
    of step s sees the updates of the microbatches before the step's last one (that one's losses
    reach the sampler just before the next draw, `DeferredUpdates`): a history complete after
    microbatch m (0-based) serves the first step s with s x grad_accum - 1 > m. Exact as long as
    every loss is finite (a non-finite one is left out of the history, which then fills later;
    the run's end note says so). The global batch is the run's (`batch_per_proc` x its processes)."""
    uniform = UniformSampler(timesteps)
    counts = np.zeros(timesteps, dtype=np.int64)
    for m in range(steps * grad_accum):
        t, _ = uniform.sample_from_uniform(timestep_uniforms(seed, m, global_batch))
        counts += np.bincount(t.numpy(), minlength=timesteps)
        if (counts >= history).all():
            return -(-(m + 2) // grad_accum)
    return None


def check_steers(params, processes: int) -> None:
    """`grad-norm` draws uniformly until its loss history is full and every bucket has been measured
    after that: a run whose buckets are measured only before then, or only on its last step, would
    draw uniformly all run under grad-norm's name. Refused (one ParamsError line) by check-params
    (`processes`: train.nproc x train.nodes) and by train before it writes anything (its world size:
    other nodes draw other t). When the history fills is known before the run: `steering_step`.
    Nothing to check for the other samplers, or without buckets (params.py refuses grad-norm then)."""
    t, ip = params.train, params.introspect
    if t.timestep_sampler != "grad-norm" or ip.noise_buckets == 0:
        return
    batch = t.batch_per_proc * processes
    first = steering_step(seed=t.seed, timesteps=params.diffusion.timesteps, global_batch=batch,
                          grad_accum=t.grad_accum, steps=t.steps)
    history = (f"its loss history ({SAMPLER_HISTORY} losses for each of {params.diffusion.timesteps} t; this "
               f"run's draws replayed, {batch * t.grad_accum} images a step)")
    if first is None:
        raise ParamsError(f"train.timestep_sampler: 'grad-norm' would draw uniformly all run: {history} is not "
                          f"full before the last step {t.steps}; train longer or with a larger batch, or pick "
                          "another sampler")
    if not any(levels_measured_at(s, ip, last=t.steps) for s in range(first, t.steps)):
        raise ParamsError(
            f"train.timestep_sampler: 'grad-norm' would draw uniformly all run: {history} can steer from step "
            f"{first}, and no noise-level buckets are measured from then until before the last step {t.steps}; "
            "add such steps to introspect.steps, or set introspect.every and noise_levels_every to divide them, "
            "or pick another sampler")


def check_history_fills(params, processes: int) -> str | None:
    """IDDPM's samplers (`loss-second-moment`, `output-grad-norm`) draw uniformly until their history
    (`SAMPLER_HISTORY` values at every t) is full: a run too short for it draws uniformly all run
    under the sampler's name (found from outside: two 60-step runs with either sampler gave the same
    bits, and nothing said so). `output-grad-norm` is chosen for what it draws: refused (one
    ParamsError line), as `check_steers` refuses grad-norm. `loss-second-moment`, the default and
    IDDPM's own warm-up, which quick runs go through: returns a note to print. None where it fills.
    `processes`: train.nproc x train.nodes, as for `check_steers`."""
    t = params.train
    if t.timestep_sampler not in ("loss-second-moment", "output-grad-norm"):
        return None
    batch = t.batch_per_proc * processes
    first = steering_step(seed=t.seed, timesteps=params.diffusion.timesteps, global_batch=batch,
                          grad_accum=t.grad_accum, steps=t.steps)
    if first is not None and first <= t.steps:  # a draw of the run comes after the history filled
        return None
    why = (f"train.timestep_sampler: '{t.timestep_sampler}' would draw uniformly all run: its history "
           f"({SAMPLER_HISTORY} values for each of {params.diffusion.timesteps} t; this run's draws replayed, "
           f"{batch * t.grad_accum} images a step) is not full before the last step {t.steps}")
    if t.timestep_sampler == "output-grad-norm":
        raise ParamsError(f"{why}; train longer or with a larger batch, or pick another sampler")
    return f"note: {why} (IDDPM's warm-up); train longer or with a larger batch to sample by importance"


def gather_for_sampler(t: torch.Tensor, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers (t, loss) from every rank, in global-batch order, on their device; identity
    without a group.

    Rank r holds the examples r, r + W, r + 2W, ... of the global batch (DistributedSampler),
    so interleaving the gathered rows restores the order one process with the whole batch
    would see, and the sampler's history is the same whatever the world size.
    """
    t, losses = t.detach(), losses.detach().float()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t, losses
    ts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    ls = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t)
    dist.all_gather(ls, losses)
    return torch.stack(ts, 1).reshape(-1), torch.stack(ls, 1).reshape(-1)


class PendingUpdate:
    """One microbatch's (t, loss) (or another per-example value), gathered over ranks, on their way
    to the host.

    `update` runs on the host; calling `.cpu()` right after the forward pass would stall the host
    until the GPU got there, once per step. Instead the copy is queued (pinned memory, non-blocking)
    and `apply_to` runs just before the next draw, when the GPU has long finished it. The sampler
    sees exactly the same updates in the same order, so results do not change.
    """

    def __init__(self, t: torch.Tensor, losses: torch.Tensor):
        t, losses = gather_for_sampler(t, losses)
        self.event = None
        if t.device.type == "cuda":
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            self.losses = torch.empty(losses.shape, dtype=losses.dtype, pin_memory=True).copy_(losses, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.t, self.losses = t.cpu(), losses.cpu()

    def apply_to(self, sampler: UniformSampler) -> None:
        if self.event is not None:
            self.event.synchronize()
        sampler.update(self.t, self.losses)


class DeferredUpdates:
    """The sampler updates still on their way to the host, applied in order by `flush` (just before
    the next draw, and before the sampler's state is saved). A sampler that learns nothing per
    example (uniform) gets nothing gathered or queued; `output-grad-norm` gets hooks on
    the model's output layer (output_grads.py), and only it: the other samplers' runs are unchanged."""

    def __init__(self, sampler: UniformSampler, model: torch.nn.Module | None = None, grad_accum: int = 1):
        self.sampler, self.pending, self.grad_accum = sampler, [], grad_accum
        self.output_grads = OutputGradNorms(model) if sampler.learns_from == "output_grads" else None

    def add(self, t: torch.Tensor, losses: torch.Tensor, weights: torch.Tensor, loss_scale: float) -> None:
        """After a microbatch's backward pass of loss_scale x mean(weights x losses) / grad_accum:
        queues what the sampler learns from, per example. The output layer's norms are divided by
        what that pass multiplied each example's own unweighted loss by."""
        if self.sampler.learns_from == "losses":
            self.pending.append(PendingUpdate(t, losses))
        elif self.sampler.learns_from == "output_grads":
            multiplier = loss_scale * weights.float() / (len(t) * self.grad_accum)
            self.pending.append(PendingUpdate(t, self.output_grads.norms() / multiplier))

    def flush(self) -> None:
        while self.pending:
            self.pending.pop(0).apply_to(self.sampler)


def create_sampler(name: str, num_timesteps: int, bucket_of_t: np.ndarray | None = None) -> UniformSampler:
    """`bucket_of_t`: the noise-level bucket of every t, which `grad-norm` estimates by."""
    if name == "uniform":
        return UniformSampler(num_timesteps)
    if name == "loss-second-moment":
        return LossSecondMomentSampler(num_timesteps)
    if name == "output-grad-norm":
        return OutputGradNormSampler(num_timesteps)
    if name == "grad-norm":
        if bucket_of_t is None or len(bucket_of_t) != num_timesteps:
            raise ValueError("the grad-norm sampler needs the noise-level buckets of every timestep")
        return GradNormSampler(bucket_of_t)
    raise ValueError(f"unknown timestep sampler {name!r}")
