"""Gradients by noise level: which noise levels drive the update, and whether they pull against
each other (the "conflicting optimization directions" of Min-SNR, Hang et al. 2023; the negative
transfer between timesteps of Go et al. 2023).

On a recorded step the batch's loss is split by each example's timestep into buckets (`t` or
log-SNR edges), and each bucket's part of the step's gradient, G_b, is computed exactly:
G = sum_b G_b (the loss is a sum over examples, so the gradient is too). Each bucket is split
once more into two halves by the position of its examples in the batch (even, odd), so that each
bucket also gets its own noise scale, and the whole batch the one of `noise_scale.py` when the step
has no smaller batch of its own. For every bucket the table gets

- `grad_norm` |G_b|, and `share` <G_b, G> / |G|², its projection on the total: the shares add up
  to 1, and a negative share is a bucket working against the step;
- `cos`: the cosine between G_b and every bucket's gradient (the conflict matrix, row b);
- `g2`, `trace`, `b_simple`: the two-batch estimates of |G|², tr(Σ) and B_simple of the bucket's
  own mean gradient, from its halves (unreliable with few examples: see docs/INTROSPECTION.md).

Cost: on the steps of `introspect.noise_levels_every` only (recording.py), 2 x buckets extra
backward passes through the microbatch's graph (autograd.grad with the graph retained, so the
training's own backward and its numbers are untouched), and 2 x buckets copies of the gradient;
nothing on other steps. One batched vector-Jacobian product over the bucket halves' one-hot
cotangents (`is_grads_batched`) computes the same numbers but is no faster on a CPU (the same
arithmetic, vmapped: benchmarks/introspect_overhead.py --section vjp), so the loop stays.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..params import ParamsError
from ..runtime import distributed as D
from .noise_scale import two_batch_estimates


def bucket_table(alphas_cumprod: np.ndarray, *, count: int, edges: list[float], space: str) -> tuple[np.ndarray, list]:
    """(the bucket of every timestep t = 0..T-1, [(lo, hi)] of each bucket in `space`'s units).

    `edges` are the interior edges, ascending, in `space`'s units ("t", or "logsnr":
    log(ᾱ/(1-ᾱ))); without them, `count` buckets of equal width over the schedule's range. A bucket
    is [lo, hi). Buckets are numbered from the least noisy: from low t, or from high log-SNR."""
    T = len(alphas_cumprod)
    if space == "t":
        value = np.arange(T, dtype=np.float64)
        lo, hi = 0.0, float(T)
    else:
        value = np.log(alphas_cumprod) - np.log1p(-alphas_cumprod)
        lo, hi = float(value.min()), float(value.max())
    inner = list(edges) if edges else [lo + (hi - lo) * k / count for k in range(1, count)]
    bounds = [lo, *inner, hi]
    which = np.searchsorted(np.asarray(inner), value, side="right")  # 0 = lowest value
    spans = list(zip(bounds[:-1], bounds[1:]))
    if space == "logsnr":  # low log-SNR is high noise: number from the high end
        which = len(inner) - which
        spans = spans[::-1]
    return which.astype(np.int64), spans


DEFAULT_BUCKETS = 4


def default_bucket_count(alphas_cumprod: np.ndarray, space: str, batch_per_step: int) -> int:
    """`introspect.noise_buckets: null`: 4 equal buckets, or the most (down to 1, the whole batch, whose
    halves still give the noise scale) whose every bucket expects 2 examples per step under uniform t."""
    T = len(alphas_cumprod)
    for count in range(DEFAULT_BUCKETS, 1, -1):
        which, _ = bucket_table(alphas_cumprod, count=count, edges=[], space=space)
        if min(np.bincount(which, minlength=count)) * batch_per_step / T >= 2:
            return count
    return 1


class NoiseLevelGradients:
    """Per recorded step: `measure(...)` after each microbatch's forward, `finish()` after the last.

    Every rank computes its own examples' bucket gradients; `finish` sums them over ranks (one
    all-reduce of 2 x buckets gradients) as DDP averages the training's, so every number is that of
    the global batch."""

    def __init__(self, raw_model: torch.nn.Module, alphas_cumprod, ip, *, batch_per_step: int, device):
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        key = "introspect.noise_bucket_edges" if ip.noise_bucket_edges else "introspect.noise_buckets"
        ac = np.asarray(alphas_cumprod, dtype=np.float64)
        count = len(ip.noise_bucket_edges) + 1 if ip.noise_bucket_edges else \
            ip.noise_buckets or default_bucket_count(ac, ip.noise_bucket_space, batch_per_step)
        which, self.spans = bucket_table(ac, count=count, edges=ip.noise_bucket_edges, space=ip.noise_bucket_space)
        if ip.noise_bucket_edges and ip.noise_bucket_space == "logsnr":
            top = float(np.log(ac[0]) - np.log1p(-ac[0]))
            bottom = float(np.log(ac[-1]) - np.log1p(-ac[-1]))
            if not (bottom < min(ip.noise_bucket_edges) and max(ip.noise_bucket_edges) < top):
                raise ParamsError(f"{key}: log-SNR edges must lie inside this schedule's range "
                                  f"({bottom:.3g}, {top:.3g}), got {ip.noise_bucket_edges}")
        # A bucket needs examples every step: 2 at least (its halves), in expectation under uniform t.
        counts = np.bincount(which, minlength=count)
        for b, n in enumerate(counts):
            expected = batch_per_step * n / len(ac)
            if expected < 2:
                lo, hi = self.spans[b]
                raise ParamsError(f"{key}: bucket {b} [{lo:.4g}, {hi:.4g}) holds {n} of {len(ac)} timesteps, "
                                  f"{expected:.2g} examples per step at the global batch of {batch_per_step}; "
                                  "it needs 2 or more (widen it, use fewer buckets or a larger batch)")
        self.bucket_of_t = torch.from_numpy(which).to(device)
        self.count, self.space, self.batch_per_step = count, ip.noise_bucket_space, batch_per_step
        self.size = sum(p.numel() for p in self.params)
        self._acc = None  # (2 * count, P) float32: bucket b, half h in row 2b + h
        self._n = torch.zeros(2 * count, dtype=torch.float64, device=device)

    def measure(self, weighted_losses: torch.Tensor, t: torch.Tensor, *, grad_multiplier: float, loss_scale: float,
                batch: int) -> None:
        """The bucket-and-half parts of this microbatch's gradient. `weighted_losses` (B,) are the
        per-example losses times their importance weights, whose mean over `batch` examples, times
        `grad_multiplier` (1/grad_accum), the training backpropagates. The graph is kept for it."""
        if self._acc is None:
            self._acc = torch.zeros(2 * self.count, self.size, dtype=torch.float32, device=self.params[0].device)
        rows = self.bucket_of_t[t] * 2 + torch.arange(len(t), device=t.device) % 2  # (B,) position parity: halves
        present = torch.unique(rows).tolist()  # one host sync, on recorded steps only
        # fp16: through the loss scale as the training's backward, or small gradients underflow.
        scale = grad_multiplier * loss_scale / batch
        for row in present:
            part = torch.where(rows == row, weighted_losses, 0.0).sum() * scale
            grads = torch.autograd.grad(part, self.params, retain_graph=True, allow_unused=True)
            flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                              for g, p in zip(grads, self.params)])
            self._acc[row].add_(flat, alpha=1.0 / loss_scale)
        self._n.index_add_(0, rows, torch.ones(len(rows), dtype=torch.float64, device=rows.device))

    @torch.no_grad()
    def finish(self) -> tuple[list[dict], tuple[float, float]]:
        """(one row per bucket for the table, the whole batch's (|G|², tr(Σ)) from its two halves);
        a collective under DDP: every rank calls it."""
        acc, n = self._acc, self._n
        if D.world_size() > 1:
            D.all_reduce_sum_(acc)
            D.all_reduce_sum_(n)
            acc /= D.world_size()  # DDP averages the ranks' gradients
        acc64 = acc.double()
        halves = acc64.view(self.count, 2, -1)               # G_bh: (K, 2, P)
        buckets = halves.sum(1)                               # G_b
        total = buckets.sum(0)                                # G, the step's gradient (pre-clipping)
        gram = buckets @ buckets.T                            # <G_b, G_c>
        total_sq = float(total @ total)
        norms = gram.diagonal().sqrt()
        n_h = n.view(self.count, 2)
        n_b = n_h.sum(1)
        N = float(n.sum())
        # Mean gradients (sums over examples / examples): G_b is a sum over the bucket's examples / N.
        half_sq = (halves.square().sum(-1) * (N / n_h.clamp(min=1)) ** 2).tolist()
        bucket_sq = (norms.square() * (N / n_b.clamp(min=1)) ** 2).tolist()
        rows = []
        for b in range(self.count):
            nb = float(n_b[b])
            g2, trace = two_batch_estimates(bucket_sq[b], nb, [(half_sq[b][h], float(n_h[b, h])) for h in range(2)])
            lo, hi = self.spans[b]
            rows.append({
                "bucket": b, "space": self.space, "lo": lo, "hi": hi, "examples": int(nb),
                "grad_norm": float(norms[b]),
                "share": float(gram[b].sum()) / total_sq if total_sq > 0 else math.nan,
                "cos": [float(gram[b, c] / (norms[b] * norms[c])) if norms[b] * norms[c] > 0 else math.nan
                        for c in range(self.count)],
                "g2": g2, "trace": trace, "b_simple": trace / g2 if g2 > 0 else math.nan,
            })
        # The whole batch from its halves (even / odd positions, across buckets): i.i.d. subsets.
        whole = halves.sum(0)                                  # (2, P)
        n_whole = n_h.sum(0)
        whole_sq = [float(whole[h] @ whole[h]) * (N / float(n_whole[h])) ** 2 if n_whole[h] else math.nan
                    for h in range(2)]
        estimate = two_batch_estimates(total_sq, N, [(whole_sq[h], float(n_whole[h])) for h in range(2)])
        self._acc.zero_()
        self._n.zero_()
        return rows, estimate

    def total(self) -> torch.Tensor:
        """The sum of the bucket parts measured so far on this rank (for tests: the step's local gradient)."""
        return self._acc.sum(0)
