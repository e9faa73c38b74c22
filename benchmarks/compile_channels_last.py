"""Would `channels_last` or `torch.compile` pay? The hand-written loop of train_step.py on the same
UNet and batch, eager against each variant, in benchmarks/timing.py's paired rounds.

    PYTHONPATH=src python benchmarks/compile_channels_last.py              # channels_last only
    PYTHONPATH=src python benchmarks/compile_channels_last.py --compile    # + torch.compile (minutes to compile on CPU)

Prints images/s and step time / eager per round (median and spread); results are written down in
docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import tempfile
import time
import types
from pathlib import Path

import torch

from ddpmrepro import params as P
from ddpmrepro.data import prepare
from timing import fmt_ratio, paired_rounds  # benchmarks/ (the script's directory) is on sys.path
from train_step import PlainLoop, cuda_sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="training steps per block")
    a = ap.parse_args()
    cfg = types.SimpleNamespace(device=a.device, preset="tiny", image_size=8, channels=1, batch=a.batch,
                                precision="fp32")
    p, total = P.TrainParams(), (a.rounds + 2) * a.steps + 3
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "prepared"
        prepare(P.DataParams(), data)
        loops = {"eager": PlainLoop(cfg, p, data, "plain", total), "channels_last": PlainLoop(cfg, p, data, "plain", total)}
        loops["channels_last"].model.to(memory_format=torch.channels_last)
        loops["channels_last"].resolve_params()
        if a.compile:
            loops["compile"] = PlainLoop(cfg, p, data, "plain", total)
            loops["compile"].model = torch.compile(loops["compile"].model)
            t0 = time.perf_counter()
            loops["compile"].run(3)
            print(f"compile: first steps took {time.perf_counter() - t0:.0f} s", flush=True)
        timing = paired_rounds({k: (lambda loop=loop: loop.run(a.steps)) for k, loop in loops.items()}, "eager",
                               a.rounds, warmup=2, sync=cuda_sync(a.device))
    print(f"{timing['before']['torch_threads']} threads, load {timing['before']['load_avg'][0]:.2f} -> "
          f"{timing['after']['load_avg'][0]:.2f}")
    for name in loops:
        ips = a.steps * a.batch / timing["wall_s"][name]["median"]
        print(f"{name:14} {ips:7.0f} img/s  step time / eager {fmt_ratio(timing['ratio_wall'][name])}")

if __name__ == "__main__":
    main()
