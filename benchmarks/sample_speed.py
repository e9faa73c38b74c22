"""Sampling speed: images/s of DDIM-50 and DDPM-1000, and ddpmrepro's overhead over the bare UNet.

    PYTHONPATH=src python benchmarks/sample_speed.py --threads 1   # CPU: tiny UNet, 1x8x8, guidance 0.5
    PYTHONPATH=src python benchmarks/sample_speed.py               # torch's default thread count
    PYTHONPATH=src python benchmarks/sample_speed.py --quick
    PYTHONPATH=src python benchmarks/sample_speed.py --device cuda --preset ddpm-cifar10 --image-size 32 --channels 3

For each sampler, two contenders on one model (random weights: speed does not depend on them):
  ddpmrepro  `ddpmrepro.evaluation.sample.generate`: per-image seeded noise, classifier-free guidance (one
             doubled batch), the diffusion update, uint8 conversion: what `ddpmrepro sample` runs
  bare       the same number of UNet forward passes on the same doubled batch, nothing else
  ddpmrepro+compile  (--compile) `generate` on a copy of the model whose blocks are compiled
             (`sample.compile: blocks`); its first block, with the compilation, is timed on its own
  ddpmrepro+graphs   (--graphs) `generate` with the network replayed from CUDA graphs
             (`sample.cuda_graphs`; on a CPU the same code without capture); with --compile also
             `ddpmrepro+compile+graphs`. Their first block (the capture) is timed on its own, and
             their images are compared with eager ddpmrepro's (`vs_eager_images`: the largest uint8
             difference and the share of identical values; the goal is within one level)
  ddpmrepro+bf16     (--precision bf16, or fp16) `generate` with the network under autocast
             (`sample.precision`), and with --graphs `ddpmrepro+bf16+graphs`; their images are
             compared with eager fp32's the same way (they differ by the network's rounding)
  ddpmrepro+cl       (--channels-last) `generate` with a copy of the network in NHWC
             (`sample.channels_last`), and with --graphs each graphed contender's NHWC twin
             (`...+cl`, the bf16 one included); images compared with eager fp32's
A block is one whole sampling run of a batch. Timing: benchmarks/timing.py's paired rounds
(both contenders once per round in random order); overhead = per-round time(ddpmrepro) /
time(bare) - 1, median and spread over rounds (target <= 5%).
Writes benchmarks/results/sample_speed[-<device>-<preset>]-threads<N>.json.
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from ddpmrepro import params as P
from ddpmrepro.model.diffusion import from_params
from ddpmrepro.evaluation.sample import generate
from ddpmrepro.model.unet import PRESETS, build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import fmt_ratio, paired_ratios, paired_rounds, spread, verdict

SAMPLERS = {"ddim50": ("ddim", "ddim50"), "ddpm1000": ("ddpm", "")}
TARGET = 1.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images and repeats")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=250, help="images per batch (sample.batch_size)")
    ap.add_argument("--guidance", type=float, default=0.5)
    ap.add_argument("--ddpm-images", type=int, default=10, help="images per DDPM-1000 block (it is 20x longer)")
    ap.add_argument("--rounds", type=int, default=12, help="DDIM-50: rounds of one block per contender, random order")
    ap.add_argument("--ddpm-rounds", type=int, default=8, help="DDPM-1000: the same (its blocks are the long ones)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed blocks per contender before the rounds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--samplers", default=",".join(SAMPLERS), help="which of " + ", ".join(SAMPLERS))
    ap.add_argument("--compile", action="store_true", help="also ddpmrepro with sample.compile: blocks")
    ap.add_argument("--graphs", action="store_true", help="also ddpmrepro with sample.cuda_graphs")
    ap.add_argument("--channels-last", action="store_true",
                    help="also ddpmrepro with sample.channels_last (and with graphs, with --graphs)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="also ddpmrepro with sample.precision at this dtype (and with graphs, with --graphs)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batch, a.ddpm_images, a.rounds, a.ddpm_rounds = 50, 4, 8, 6
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = build_unet(P.ModelParams(preset=a.preset), image_size=a.image_size, in_channels=a.channels,
                       num_classes=a.classes, learn_sigma=False)
    # The layers a UNet starts at zero (each block's last convolution, the output) get PyTorch's default
    # initialisation, so the network's output depends on its input and the contenders' images compare
    # something: with the output layer at zero every contender's images would be the noise's alone.
    for q in model.parameters():
        if q.dim() > 1 and not q.any():
            torch.nn.init.kaiming_uniform_(q, a=5 ** 0.5)
    model = model.to(device).eval()
    shape = (a.channels, a.image_size, a.image_size)
    # the other contenders' networks: compiled blocks, CUDA graphs, both
    variants = {}
    if a.compile:
        import copy

        from ddpmrepro.runtime.compilation import compile_blocks

        variants["ddpmrepro+compile"] = copy.deepcopy(model)
        compile_blocks(variants["ddpmrepro+compile"])
    if a.graphs:
        from ddpmrepro.runtime.graphed_network import GraphedNetwork

        variants["ddpmrepro+graphs"] = GraphedNetwork(model, device)
        if a.compile:
            variants["ddpmrepro+compile+graphs"] = GraphedNetwork(variants["ddpmrepro+compile"], device)
    if a.precision != "fp32":  # sample.precision: the network under autocast, alone and with graphs
        from ddpmrepro.runtime.autocast_network import with_precision

        low = variants[f"ddpmrepro+{a.precision}"] = with_precision(model, a.precision, device)
        if a.graphs:
            variants[f"ddpmrepro+{a.precision}+graphs"] = GraphedNetwork(low, device)
    if a.channels_last:  # sample.channels_last: an NHWC copy of the network, alone and as each graphed contender
        import copy

        from ddpmrepro.runtime.autocast_network import with_precision
        from ddpmrepro.runtime.graphed_network import GraphedNetwork

        nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last)
        variants["ddpmrepro+cl"] = nhwc
        if a.graphs:
            variants["ddpmrepro+graphs+cl"] = GraphedNetwork(nhwc, device)
            if a.precision != "fp32":
                variants[f"ddpmrepro+{a.precision}+graphs+cl"] = GraphedNetwork(
                    with_precision(nhwc, a.precision, device), device)
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

        blocks = {"ddpmrepro": ours, "bare": bare}
        first_block_s, images = {}, {}
        eager_images = generate(model, diffusion, labels, seeds, p, a.classes, shape, device) if variants else None
        for mode, net in variants.items():
            def variant(net=net):
                return generate(net, diffusion, labels, seeds, p, a.classes, shape, device)
            t0 = time.perf_counter()
            out = variant()  # compilation or capture happen here
            sync()
            first_block_s[mode] = time.perf_counter() - t0
            diff = (out.int() - eager_images.int()).abs()
            images[mode] = {"max_uint8_difference": int(diff.max()), "identical": float((diff == 0).float().mean())}
            print(f"{name}: first block of {mode} {first_block_s[mode]:.1f} s; images against eager: "
                  f"{images[mode]}", flush=True)
            blocks[mode] = variant
        rounds = a.rounds if sampler == "ddim" else a.ddpm_rounds

        def progress(r, times, n=n, name=name, rounds=rounds):
            print(f"{name} round {r + 1}/{rounds}: " + ", ".join(f"{m} {n / w:.1f} img/s" for m, (w, _) in times.items()),
                  flush=True)

        timing = paired_rounds(blocks, "bare", rounds, warmup=a.warmup, seed=a.seed,
                               sync=sync, progress=progress)
        ratio = timing["ratio_wall"]["ddpmrepro"]
        results[name] = {"images": n, "steps": steps, "forward_batch": doubled,
                         "images_per_sec": {m: n / s["median"] for m, s in timing["wall_s"].items()},
                         "time_ratio_vs_bare": ratio, "overhead_pct": 100 * (ratio["median"] - 1),
                         "verdict": verdict(ratio, TARGET), "timing": timing}
        for mode in variants:  # each against eager ddpmrepro, paired by round
            per_round = {m: timing["wall_s"][m]["per_round"] for m in ("ddpmrepro", mode)}
            vs_eager = spread(paired_ratios(per_round, mode, "ddpmrepro"))
            results[name].setdefault("vs_eager", {})[mode] = {"time_ratio": vs_eager,
                                                              "first_block_s": first_block_s[mode],
                                                              "images": images[mode]}
            print(f"{name}: {mode} / eager ddpmrepro {fmt_ratio(vs_eager)}", flush=True)
            if mode == "ddpmrepro+compile":  # the keys of earlier results files
                results[name]["first_compiled_block_s"] = first_block_s[mode]
                results[name]["compiled_vs_eager"] = vs_eager
        print(f"{name}: {n} images, {steps} steps, forward batch {doubled}: time / bare UNet {fmt_ratio(ratio)}, "
              f"cpu {timing['ratio_cpu']['ddpmrepro']['median']:.3f}; target <= {TARGET}: {results[name]['verdict']}",
              flush=True)
    result = {
        "command": command_line("sample_speed.py", a, skip=("quick", "out")),
        "preset": a.preset, "image": list(shape), "guidance": a.guidance,
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "params": sum(q.numel() for q in model.parameters()), "samplers": results,
        "target": {"what": f"ddpmrepro / bare UNet forwards time <= {TARGET}", "ratio": TARGET},
    }
    tag = "" if (a.device, a.preset) == ("cpu", "tiny") else f"-{a.device}-{a.preset}"
    tag += "-compile" if a.compile else ""
    tag += "-graphs" if a.graphs else ""
    tag += f"-{a.precision}" if a.precision != "fp32" else ""
    tag += "-cl" if a.channels_last else ""
    out = a.out or Path(f"benchmarks/results/sample_speed{tag}{'-quick' if a.quick else ''}-threads{result['threads']}.json")
    write_result(result, out)


if __name__ == "__main__":
    main()
