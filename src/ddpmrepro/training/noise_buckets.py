"""Which noise-level bucket each timestep falls in, and which bucket layouts can hold examples.

numpy only: the `check_params` stage (pipeline/check_params.py) refuses a layout that would leave
a bucket empty before `dvc repro` removes any output, without importing torch, and
`noise_levels.py` measures with the very same table, so the rule that validates is the rule that
buckets.
"""
from __future__ import annotations

import numpy as np

DEFAULT_BUCKETS = 4


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
        value = log_snr(alphas_cumprod)
        lo, hi = float(value.min()), float(value.max())
    inner = list(edges) if edges else [lo + (hi - lo) * k / count for k in range(1, count)]
    bounds = [lo, *inner, hi]
    which = np.searchsorted(np.asarray(inner), value, side="right")  # 0 = lowest value
    spans = list(zip(bounds[:-1], bounds[1:]))
    if space == "logsnr":  # low log-SNR is high noise: number from the high end
        which = len(inner) - which
        spans = spans[::-1]
    return which.astype(np.int64), spans


def log_snr(alphas_cumprod: np.ndarray) -> np.ndarray:
    """log(ᾱ / (1 - ᾱ)) per timestep, float64."""
    ac = np.asarray(alphas_cumprod, dtype=np.float64)
    return np.log(ac) - np.log1p(-ac)


def default_bucket_count(alphas_cumprod: np.ndarray, space: str, batch_per_step: int) -> int:
    """`introspect.noise_buckets: null`: 4 equal buckets, or the most (down to 1, the whole batch, whose
    halves still give the noise scale) whose every bucket expects 2 examples per step under uniform t."""
    T = len(alphas_cumprod)
    for count in range(DEFAULT_BUCKETS, 1, -1):
        which, _ = bucket_table(alphas_cumprod, count=count, edges=[], space=space)
        if min(np.bincount(which, minlength=count)) * batch_per_step / T >= 2:
            return count
    return 1


def checked_layout(alphas_cumprod: np.ndarray, *, buckets: int | None, edges: list[float], space: str,
                   batch_per_step: int) -> tuple[int, np.ndarray, list] | None:
    """(count, the bucket of every t, spans) of the `introspect:` keys, or ValueError with one line
    naming the key: edges outside the schedule, or a bucket that expects fewer than 2 examples per
    step at `batch_per_step` under uniform t (its halves each need one). None where the buckets
    are off: `noise_buckets: 0`, or null (fit to the batch) at a batch of 1, which no bucket fits."""
    if buckets == 0 and not edges or buckets is None and not edges and batch_per_step < 2:
        return None
    ac = np.asarray(alphas_cumprod, dtype=np.float64)
    T = len(ac)
    key = "introspect.noise_bucket_edges" if edges else "introspect.noise_buckets"
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"{key}: {list(edges)} must be strictly ascending")
    if edges and space == "t":
        bad = [e for e in edges if not 0 < e < T]
        if bad:
            raise ValueError(f"{key}: {bad[0]} is outside (0, {T}) (t edges, diffusion.timesteps: {T})")
    if edges and space == "logsnr":
        values = log_snr(ac)
        bottom, top = float(values.min()), float(values.max())
        if not (bottom < min(edges) and max(edges) < top):
            raise ValueError(f"{key}: log-SNR edges must lie inside this schedule's range ({bottom:.3g}, {top:.3g}), "
                             f"got {list(edges)}")
    count = len(edges) + 1 if edges else buckets or default_bucket_count(ac, space, batch_per_step)
    which, spans = bucket_table(ac, count=count, edges=edges, space=space)
    for b, n in enumerate(np.bincount(which, minlength=count)):
        expected = batch_per_step * n / T
        if expected < 2:
            lo, hi = spans[b]
            raise ValueError(f"{key}: bucket {b} holds {n} of {T} timesteps ([{lo:.4g}, {hi:.4g})), {expected:.2g} "
                             f"examples per step at the global batch of {batch_per_step}; it needs 2 or more "
                             "(widen it, use fewer buckets or a larger batch)")
    return count, which, spans


__all__ = ["DEFAULT_BUCKETS", "bucket_table", "log_snr", "default_bucket_count", "checked_layout"]
