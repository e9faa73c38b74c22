"""How the training step's cost grows with image size and model size, next to the work it does.

    PYTHONPATH=src python benchmarks/growth.py                    # CPU: tiny and ddpm-cifar10 at 8, 16, 32 px
    PYTHONPATH=src python benchmarks/growth.py --device cuda --batch 128 --precision bf16

For each (preset, image size): the UNet's parameters, the FLOPs of one training step per image
(forward + backward, counted by torch.utils.flop_counter), and ddpmrepro's measured training
throughput (`ddpmrepro.train.train()`, introspection off). Achieved FLOP/s = FLOPs x images/s;
if it stays roughly flat as the work grows, the loop adds no cost that grows out of proportion.
On a GPU, MFU = achieved / peak (pass --peak-tflops for the device's dense peak at that precision).
Writes benchmarks/results/growth[-<tag>].json.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from ddpmrepro import params as P
from ddpmrepro.data import prepare
from ddpmrepro.unet import PRESETS, build_unet

from train_step import run_ddpmrepro  # noqa: E402  (benchmarks/ is the script's own directory)
from results_io import command_line, write_result


def train_flops_per_image(preset: str, size: int, channels: int, classes: int = 10) -> tuple[int, int]:
    model = build_unet(P.ModelParams(preset=preset), image_size=size, in_channels=channels, num_classes=classes,
                       learn_sigma=False)
    x, t, y = torch.randn(2, channels, size, size), torch.tensor([10, 500]), torch.tensor([1, 2])
    with FlopCounterMode(display=False) as counter:
        model(x, t, y).square().mean().backward()
    return sum(p.numel() for p in model.parameters()), counter.get_total_flops() // 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,ddpm-cifar10")
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after as many warm-up steps)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (0: not reported)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for size in map(int, a.sizes.split(",")):
            data_dir = tmp / f"prepared{size}"
            prepare(P.DataParams(image_size=size, channels=a.channels), data_dir)
            for preset in a.presets.split(","):
                nparams, flops = train_flops_per_image(preset, size, a.channels)
                cfg = SimpleNamespace(image_size=size, channels=a.channels, preset=preset, batch=a.batch,
                                      steps=a.steps, warmup=a.steps, device=a.device, precision=a.precision)
                ips = run_ddpmrepro(cfg, data_dir, tmp, "uniform")
                achieved = flops * ips
                rows.append({"preset": preset, "image_size": size, "params": nparams,
                             "train_gflops_per_image": flops / 1e9, "images_per_sec": ips,
                             "step_seconds": a.batch / ips, "achieved_tflops": achieved / 1e12,
                             "mfu": achieved / (a.peak_tflops * 1e12) if a.peak_tflops else None})
                r = rows[-1]
                print(f"{preset:13} {size:3d}px {nparams / 1e6:6.2f}M params {r['train_gflops_per_image']:8.3f} "
                      f"GFLOP/img {ips:9.1f} img/s  step {r['step_seconds']:.3f}s  {achieved / 1e9:7.1f} GFLOP/s",
                      flush=True)
    result = {
        "command": command_line("growth.py", a),
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "precision": a.precision,
        "batch": a.batch, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "rows": rows,
    }
    tag = "" if a.device == "cpu" else f"-{a.device}-{a.precision}"
    out = a.out or Path(f"benchmarks/results/growth{tag}.json")
    write_result(result, out)


if __name__ == "__main__":
    main()
