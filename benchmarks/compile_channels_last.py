"""Would `channels_last` or `torch.compile` pay? The hand-written loop of train_step.py on the same
UNet and batch, eager against each variant, interleaved blocks, medians.

    PYTHONPATH=src python benchmarks/compile_channels_last.py              # channels_last only
    PYTHONPATH=src python benchmarks/compile_channels_last.py --compile    # + torch.compile (minutes to compile on CPU)

Prints images/s; results are written down in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import PlainLoop  # noqa: E402

from ddpmrepro import params as P  # noqa: E402
from ddpmrepro.data import prepare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    cfg = types.SimpleNamespace(device=a.device, preset="tiny", image_size=8, channels=1, batch=a.batch,
                                precision="fp32")
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "prepared"
        prepare(P.DataParams(), data)
        loops = {"eager": PlainLoop(cfg, data, "plain"), "channels_last": PlainLoop(cfg, data, "plain")}
        loops["channels_last"].model.to(memory_format=torch.channels_last)
        if a.compile:
            loops["compile"] = PlainLoop(cfg, data, "plain")
            loops["compile"].model = torch.compile(loops["compile"].model)
            t0 = time.perf_counter()
            loops["compile"].images_per_sec(3)
            print(f"compile: first steps took {time.perf_counter() - t0:.0f} s", flush=True)
        for loop in loops.values():
            loop.images_per_sec(5)
        rates: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(a.repeats):
            for name, loop in loops.items():
                rates[name].append(loop.images_per_sec(a.steps))
    for name, v in rates.items():
        print(f"{name:14} {statistics.median(v):7.0f} img/s  blocks {[round(x) for x in v]}")


if __name__ == "__main__":
    main()
