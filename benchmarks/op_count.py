"""The host's work per training step counted, not timed: the ATen operations each loop dispatches.

    PYTHONPATH=src python benchmarks/op_count.py                          # CPU, ddpm-cifar10's layers at width 32
    PYTHONPATH=src python benchmarks/op_count.py --device cuda --precision bf16 --model-channels 0   # on a GPU

On a GPU the training step of ddpm-cifar10 at batch 128 is bound by the host (docs/BENCHMARKS.md
"On a GPU"): the card waits while Python launches about 2,400 kernels a step. Every ATen operation
the main thread dispatches costs the host a few microseconds, and most become one kernel launch.
A count is exact and the same on every machine and every day, where a timing needs a card and
spreads; so this counts each contender's operations over one block of `--steps` steps (after a
warm-up block), with a `TorchDispatchMode` on the main thread (the read-ahead thread's draws are
off the critical path and not counted; the backward pass is, on whichever thread autograd runs it).

Contenders (benchmarks/train_step.py's, the same UNet, data and optimizer settings):
  plain             the loop one writes by hand
  ddpmrepro         `train()` with uniform timesteps; `ddpmrepro+is` with IDDPM's importance sampler
  ddpmrepro+graphs  `train.cuda_graphs`: the operations a replayed microbatch's graph holds are
                    not dispatched by the host on a GPU (one replay instead), so they are not counted
                    here either; on a CPU, where nothing is captured, the copies of the microbatch
                    function's outputs into their static buffers are counted (a replay writes them
                    in place), a handful per microbatch.
Each ddpmrepro contender's count is split into `microbatch` (the forward, loss and backward:
`forward_backward` in training/loop.py) and `rest` (the sampler, the optimizer, the EMAs, the
loss statistics, the log line of the block).

What a count does not say: what an operation costs (a convolution's kernel against a scalar's),
and where the backend differs. On a CPU, AdamW runs its foreach implementation in both loops
(it reads each parameter's step count with `.item()`: the `_local_scalar_dense` rows) where a GPU
runs the fused kernel; on a GPU, run it there (`on_gpu.sh`'s `op-count` part).
Writes benchmarks/results/op_count-<device>-<preset>[-ch<N>].json.
"""
from __future__ import annotations

import argparse
import collections
import platform
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_step as ts  # benchmarks/ (the script's directory) is on sys.path
from ddpmrepro import params as P
from ddpmrepro.data import prepare
from ddpmrepro.training import cuda_graphs
from results_io import command_line, write_result


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active, by name, under the current
    region (`region`: a name, or None for operations that are not counted)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.region: str | None = "rest"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.region is not None:
            self.counts[self.region][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Regions:
    """While active, `MicrobatchGraph`s built by `train()` mark their microbatch function's
    operations as `microbatch`, or as not counted (None) when the call is a replay."""

    current: OpCounter | None = None

    def __enter__(self):
        self.original = cuda_graphs.MicrobatchGraph.__init__
        original = self.original

        def init(graph, forward_backward, *args, **kwargs):
            def marked(mb):
                counter = Regions.current
                if counter is None:
                    return forward_backward(mb)
                replay = mb is graph.static_in and bool(graph.static_out)
                before, counter.region = counter.region, None if replay else "microbatch"
                try:
                    return forward_backward(mb)
                finally:
                    counter.region = before

            original(graph, marked, *args, **kwargs)

        cuda_graphs.MicrobatchGraph.__init__ = init
        return self

    def __exit__(self, *exc):
        cuda_graphs.MicrobatchGraph.__init__ = self.original


def count_block(loop, steps: int) -> dict[str, collections.Counter]:
    """The operations of `steps` steps of `loop`, by region."""
    counter = OpCounter()
    Regions.current = counter
    try:
        with counter:
            loop.run(steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        Regions.current = None
    return counter.counts


def per_step(counts: dict[str, collections.Counter], steps: int) -> dict:
    total = sum((c for c in counts.values()), collections.Counter())
    return {"ops_per_step": sum(total.values()) / steps,
            "regions": {r: sum(c.values()) / steps for r, c in sorted(counts.items())},
            "by_op": {op: n / steps for op, n in total.most_common()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ddpm-cifar10", choices=list(ts.PRESETS))
    ap.add_argument("--model-channels", type=int, default=32,
                    help="the base width (0: the preset's); the count depends on the layers, not their width")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="the count does not depend on it either")
    ap.add_argument("--steps", type=int, default=5, help="steps per block (and the loop's log_every)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="plain,ddpmrepro,ddpmrepro+is,ddpmrepro+graphs")
    ap.add_argument("--top", type=int, default=12, help="operations listed by their difference from plain")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    if "plain" not in modes:
        ap.error("--modes must include plain (the reference)")
    total = 4 * a.steps  # warm-up block, two counted blocks, one left for the export
    result = {"command": command_line("op_count.py", a), "preset": a.preset,
              "model_channels": ts.architecture(a)["channels"], "image": [a.channels, a.image_size, a.image_size],
              "batch": a.batch, "steps_per_block": a.steps, "precision": a.precision,
              "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
              "torch": torch.__version__, "machine": platform.machine(), "contenders": {}}
    with tempfile.TemporaryDirectory() as d, Regions():
        tmp = Path(d)
        data_dir = tmp / "prepared"
        prepare(P.DataParams(image_size=a.image_size, channels=a.channels), data_dir)
        for mode in modes:
            if mode.startswith("ddpmrepro"):
                loop = ts.DdpmreproLoop(ts.ddpmrepro_params(a, mode, total), ts.train_paths(tmp, data_dir))
            else:
                loop = ts.PlainLoop(a, ts.bench_params(a, "uniform", total).train, data_dir, mode, total)
            loop.run(a.steps)  # warm-up: builds, first backward, capture
            blocks = [per_step(count_block(loop, a.steps), a.steps) for _ in range(2)]
            if mode.startswith("ddpmrepro"):
                loop.finish()
            # Two blocks of the same steps, each with one log line: the count is the same (printed if not).
            result["contenders"][mode] = {**blocks[1], "same_in_both_blocks": blocks[0] == blocks[1]}
    plain = result["contenders"]["plain"]
    for mode, c in result["contenders"].items():
        ops = set(c["by_op"]) | set(plain["by_op"])
        diff = {op: c["by_op"].get(op, 0) - plain["by_op"].get(op, 0) for op in ops}
        c["vs_plain"] = c["ops_per_step"] / plain["ops_per_step"]
        c["more_than_plain"] = dict(sorted(((op, v) for op, v in diff.items() if v), key=lambda kv: -abs(kv[1]))[:a.top])
    tag = f"{a.device}-{a.preset}" + (f"-ch{a.model_channels}" if a.model_channels else "")
    write_result(result, a.out or Path(f"benchmarks/results/op_count-{tag}.json"))
    print(f"{a.preset} (width {result['model_channels']}), {a.device} {a.precision}, ATen operations per step "
          f"(a block of {a.steps} steps, one log line):")
    for mode, c in result["contenders"].items():
        regions = ", ".join(f"{r} {n:.1f}" for r, n in c["regions"].items())
        same = "" if c["same_in_both_blocks"] else "  (the two blocks differ)"
        print(f"  {mode:18} {c['ops_per_step']:7.1f}  x{c['vs_plain']:.3f} of plain  [{regions}]{same}")
        if mode != "plain":
            print("      " + ", ".join(f"{op} {v:+.1f}" for op, v in c["more_than_plain"].items()))


if __name__ == "__main__":
    main()
