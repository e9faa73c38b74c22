"""Paired timing rounds, the method every benchmark ratio here is measured with.

This VM's speed drifts by 10-20% over minutes and other jobs come and go, so comparing per-
contender medians of long blocks run in a fixed order measures the machine, not the code
(introspect_overhead.py once found an activation-statistics "overhead" of +25% that way; paired,
+7%: docs/BENCHMARKS.md).
So: every contender is built once and warmed up, then each round runs one short block of every
contender in a fresh random order, and a ratio is the per-round ratio against the reference
contender *of the same round*, summarised by its median, min-max and interquartile range over
rounds, with a 95% confidence interval for that median from order statistics (no assumption on
the distribution): it decides whether a target is met, missed, or cannot be resolved.
Both wall time and process CPU time are recorded: with one torch thread the CPU time is the
block's own work and barely moves with the machine's load; with more threads it counts every
thread of the process, spin-waiting OpenMP workers included, so read it next to the wall time.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import time
from typing import Callable

METHOD = ("each contender built once and warmed up; then rounds of one block per contender in a "
          "fresh random order; ratio = block time / reference block time in the same round, "
          "summarised over rounds by median, min-max, interquartile range (q1, q3) and the 95% "
          "distribution-free interval of the median (order statistics of the binomial); a target counts "
          "as met or missed only when that interval lies on one side of it")


def spread(xs: list[float]) -> dict:
    """Median, min, max and quartiles (linear interpolation between order statistics, numpy's default)."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("spread() of no values")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    k = median_ci_rank(len(xs))
    ci = [xs[k - 1], xs[len(xs) - k]] if k else None
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3,
            "median_ci95": ci, "n": len(xs)}


def median_ci_rank(n: int, level: float = 0.95) -> int:
    """The rank k of the distribution-free confidence interval [x_(k), x_(n+1-k)] for the median of n
    values: the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2. 0: n is too small."""
    tail, k, cdf = (1 - level) / 2, 0, 0.0
    while True:
        cdf += math.comb(n, k) / 2**n  # P(B <= k) = P(B < k + 1)
        if cdf > tail:
            return k
        k += 1


def verdict(ratio: dict, target: float) -> str:
    """'met' when the 95% interval of the median ratio lies at or below `target`, 'missed' when it
    lies above, 'unresolved' when it straddles the target (or there are too few rounds for one)."""
    ci = ratio["median_ci95"]
    if ci is None:
        return "unresolved (too few rounds for a 95% interval)"
    return "met" if ci[1] <= target else "missed" if ci[0] > target else "unresolved"


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """One independently shuffled order of `names` per round (reproducible from `seed`)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def machine_state() -> dict:
    """What the timings depend on besides the code: thread counts and the machine's load."""
    import torch

    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg())}


def paired_rounds(blocks: dict[str, Callable[[], object]], reference: str, rounds: int, *, warmup: int = 1,
                  seed: int = 0, sync: Callable[[], object] = lambda: None,
                  wall_clock: Callable[[], float] = time.perf_counter,
                  cpu_clock: Callable[[], float] = time.process_time,
                  progress: Callable[[int, dict], object] | None = None) -> dict:
    """Times `blocks` (name -> a callable running one block of work) in paired rounds.

    `warmup` untimed blocks of each contender come first (in the given order). `sync` is called
    before reading the clocks (torch.cuda.synchronize on a GPU). `progress(round, times)` is
    called after each round with that round's {name: (wall_s, cpu_s)}. Returns a JSON-able dict:
    per-round block times, their spread, and the per-round ratios against `reference`.
    """
    if reference not in blocks:
        raise ValueError(f"reference {reference!r} is not one of {sorted(blocks)}")
    if rounds < 1:
        raise ValueError("need at least one round")
    for block in blocks.values():
        for _ in range(warmup):
            block()
    before = machine_state()
    orders = round_orders(list(blocks), rounds, seed)
    wall: dict[str, list[float]] = {n: [] for n in blocks}
    cpu: dict[str, list[float]] = {n: [] for n in blocks}
    load1 = []
    for r, order in enumerate(orders):
        for name in order:
            sync()
            w0, c0 = wall_clock(), cpu_clock()
            blocks[name]()
            sync()
            wall[name].append(wall_clock() - w0)
            cpu[name].append(cpu_clock() - c0)
        load1.append(os.getloadavg()[0])
        if progress:
            progress(r, {n: (wall[n][-1], cpu[n][-1]) for n in blocks})
    return {
        "method": METHOD, "reference": reference, "rounds": rounds, "warmup_blocks": warmup, "seed": seed,
        "orders": orders, "before": before, "after": machine_state(), "load1_per_round": load1,
        "wall_s": {n: {"per_round": v, **spread(v)} for n, v in wall.items()},
        "cpu_s": {n: {"per_round": v, **spread(v)} for n, v in cpu.items()},
        "ratio_wall": {n: spread(paired_ratios(wall, n, reference)) for n in blocks},
        "ratio_cpu": {n: spread(paired_ratios(cpu, n, reference)) for n in blocks},
    }


def paired_ratios(times: dict[str, list[float]], name: str, reference: str) -> list[float]:
    """times[name][r] / times[reference][r] for every round r."""
    return [t / ref for t, ref in zip(times[name], times[reference], strict=True)]


def fmt_ratio(s: dict) -> str:
    """'1.031 [CI 1.02-1.04, IQR 1.01-1.05, range 0.98-1.10]': the median, its 95% interval,
    the interquartile range and min-max of the per-round ratios."""
    ci = f"CI {s['median_ci95'][0]:.3f}-{s['median_ci95'][1]:.3f}, " if s["median_ci95"] else ""
    return f"{s['median']:.3f} [{ci}IQR {s['q1']:.3f}-{s['q3']:.3f}, range {s['min']:.3f}-{s['max']:.3f}]"
