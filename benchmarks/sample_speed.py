"""Sampling speed: images/s of DDIM-50 and DDPM-1000, and ddpmrepro's overhead over the bare UNet.

    PYTHONPATH=src python benchmarks/sample_speed.py            # CPU: tiny UNet, 1x8x8, guidance 0.5
    PYTHONPATH=src python benchmarks/sample_speed.py --quick
    PYTHONPATH=src python benchmarks/sample_speed.py --device cuda --preset ddpm-cifar10 --image-size 32 --channels 3

For each sampler, two modes run interleaved (one block of each, repeated; medians):
  ddpmrepro  `ddpmrepro.sample.generate`: per-image seeded noise, classifier-free guidance (one
             doubled batch), the diffusion update, uint8 conversion: what `ddpmrepro sample` runs
  bare       the same number of UNet forward passes on the same doubled batch, nothing else
overhead = time(ddpmrepro) / time(bare) - 1 (target <= 5%). The weights are random: speed does not
depend on them. Writes benchmarks/results/sample_speed[-<tag>].json.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from ddpmrepro import params as P
from ddpmrepro.diffusion import from_params
from ddpmrepro.sample import generate
from ddpmrepro.unet import PRESETS, build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path

SAMPLERS = {"ddim50": ("ddim", "ddim50"), "ddpm1000": ("ddpm", "")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images and repeats")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=250, help="images per batch (sample.batch_size)")
    ap.add_argument("--guidance", type=float, default=0.5)
    ap.add_argument("--ddpm-images", type=int, default=50, help="images per DDPM-1000 block (it is 20x longer)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--samplers", default=",".join(SAMPLERS), help="which of " + ", ".join(SAMPLERS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batch, a.ddpm_images, a.repeats = 100, 20, 3
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = build_unet(P.ModelParams(preset=a.preset), image_size=a.image_size, in_channels=a.channels,
                       num_classes=a.classes, learn_sigma=False).to(device).eval()
    shape = (a.channels, a.image_size, a.image_size)
    results = {}
    for name in a.samplers.split(","):
        sampler, respacing = SAMPLERS[name]
        n = a.batch if sampler == "ddim" else a.ddpm_images
        p = P.SampleParams(sampler=sampler, respacing=respacing, guidance=a.guidance, batch_size=n)
        diffusion = from_params(P.DiffusionParams(), respacing=respacing)
        labels = torch.arange(n) % a.classes
        seeds = list(range(n))
        doubled = 2 * n if a.guidance else n
        x = torch.randn(doubled, *shape, device=device)
        y = torch.cat([labels, torch.full_like(labels, a.classes)])[:doubled].to(device)
        steps = diffusion.num_timesteps

        @torch.no_grad()
        def bare():
            for i in reversed(range(steps)):
                model(x, torch.full((doubled,), i, device=device), y)

        def ours():
            generate(model, diffusion, labels, seeds, p, a.classes, shape, device)

        times = {"ddpmrepro": [], "bare": []}
        ours(), bare()  # warm-up
        for _ in range(a.repeats):
            times["ddpmrepro"].append(timed(ours, device))
            times["bare"].append(timed(bare, device))
        med = {m: statistics.median(v) for m, v in times.items()}
        results[name] = {"images": n, "steps": steps, "forward_batch": doubled,
                         "images_per_sec": {m: n / t for m, t in med.items()},
                         "overhead_pct": 100 * (med["ddpmrepro"] / med["bare"] - 1),
                         "seconds": times}
        print(f"{name}: {n} images, {steps} steps, forward batch {doubled}: ddpmrepro {n / med['ddpmrepro']:.1f} img/s, "
              f"bare UNet {n / med['bare']:.1f} img/s, overhead {results[name]['overhead_pct']:+.1f}%", flush=True)
    result = {
        "command": command_line("sample_speed.py", a, skip=("quick", "out")),
        "preset": a.preset, "image": list(shape), "guidance": a.guidance,
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "params": sum(q.numel() for q in model.parameters()), "repeats": a.repeats, "samplers": results,
        "target": "overhead over bare UNet forwards <= 5%",
    }
    tag = "" if (a.device, a.preset) == ("cpu", "tiny") else f"-{a.device}-{a.preset}"
    out = a.out or Path(f"benchmarks/results/sample_speed{tag}{'-quick' if a.quick else ''}.json")
    write_result(result, out)


if __name__ == "__main__":
    main()
