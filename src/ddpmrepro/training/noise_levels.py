"""Gradients by noise level: which noise levels drive the update, and whether they pull against
each other (the "conflicting optimization directions" of Min-SNR, Hang et al. 2023; the negative
transfer between timesteps of Go et al. 2023).

On a recorded step the batch's loss is split by each example's timestep into buckets (`t` or
log-SNR edges), and each bucket's part of the step's gradient, G_b, is computed exactly:
G = sum_b G_b (the loss is a sum over examples, so the gradient is too). Each bucket is split
once more into two halves by the position of its examples in the global batch (even, odd), so that each
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
from .noise_buckets import checked_layout
from .noise_scale import two_batch_estimates


def bucket_layout(alphas_cumprod, ip, batch_per_step: int) -> tuple[int, np.ndarray, list] | None:
    """(count, the bucket of every t, spans) of the `introspect:` keys at this global batch, None when
    the buckets are off; a layout with a bucket that cannot hold examples is a one-line ParamsError
    (`noise_buckets.checked_layout`, the rule check_params refuses with too)."""
    try:
        return checked_layout(np.asarray(alphas_cumprod, dtype=np.float64), buckets=ip.noise_buckets,
                              edges=ip.noise_bucket_edges, space=ip.noise_bucket_space, batch_per_step=batch_per_step)
    except ValueError as e:
        raise ParamsError(str(e)) from None


class NoiseLevelGradients:
    """Per recorded step: `measure(...)` after each microbatch's forward, `finish()` after the last.

    Every rank computes its own examples' bucket gradients; `finish` sums them over ranks (one
    all-reduce of 2 x buckets gradients) as DDP averages the training's, so every number is that of
    the global batch."""

    def __init__(self, raw_model: torch.nn.Module, alphas_cumprod, ip, *, batch_per_step: int, device):
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        # A bucket needs examples every step: 2 at least (its halves), in expectation under uniform t.
        layout = bucket_layout(alphas_cumprod, ip, batch_per_step)
        if layout is None:
            raise ValueError("the noise-level buckets are off (introspect.noise_buckets: 0)")
        count, which, self.spans = layout
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
        # The halves by the parity of each example's place in the global microbatch, r + W l for rank r's
        # l-th (batches.py deals positions r, r + W, ... to rank r): under DDP the same split as one
        # process given the whole batch (each rank's own parity split it differently: found from outside).
        place = D.rank() + D.world_size() * torch.arange(len(t), device=t.device)
        rows = self.bucket_of_t[t] * 2 + place % 2  # (B,)
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
