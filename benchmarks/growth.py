"""How the training step's cost grows with image size and model size, next to the work it does.

    PYTHONPATH=src python benchmarks/growth.py --threads 1        # CPU: tiny and ddpm-cifar10 at 8, 16, 32 px
    PYTHONPATH=src python benchmarks/growth.py                    # torch's default thread count
    PYTHONPATH=src python benchmarks/growth.py --device cuda --batch 128 --precision bf16 --peak-tflops 989

For each (preset, image size): the UNet's parameters, the FLOPs of one training step per image
(forward + backward, counted by torch.utils.flop_counter), and ddpmrepro's measured training
throughput (`ddpmrepro.training.loop.train()`, introspection off, one run per row kept alive for the whole
benchmark). Rows are timed in benchmarks/timing.py's paired rounds: each round one block of every
row in random order, so the step-time ratio of each row to the first row (the smallest) comes
with its spread over rounds and can be read against the FLOP ratio. Achieved FLOP/s = FLOPs x
images/s; if it stays roughly flat as the work grows, the loop adds no cost that grows out of
proportion. On a GPU, MFU = achieved / peak (pass --peak-tflops for the device's dense peak at
that precision). Writes benchmarks/results/growth[-<device>-<precision>]-threads<N>.json.
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
from ddpmrepro.model.unet import PRESETS, build_unet

from train_step import DdpmreproLoop, bench_params, cuda_sync, train_paths  # noqa: E402  (benchmarks/ is on sys.path)
from results_io import command_line, write_result
from timing import fmt_ratio, paired_rounds


def train_flops_per_image(preset: str, size: int, channels: int, classes: int = 10) -> tuple[int, int]:
    model = build_unet(P.ModelParams(preset=preset), image_size=size, in_channels=channels, num_classes=classes,
                       learn_sigma=False)
    x, t, y = torch.randn(2, channels, size, size), torch.tensor([10, 500]), torch.tensor([1, 2])
    with FlopCounterMode(display=False) as counter:
        model(x, t, y).square().mean().backward()
    return sum(p.numel() for p in model.parameters()), counter.get_total_flops() // 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,ddpm-cifar10", help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="training steps per block")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one block per row, in random order")
    ap.add_argument("--warmup", type=int, default=1, help="untimed blocks per row before the rounds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (0: not reported)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    total = (a.warmup + a.rounds) * a.steps
    rows, loops = {}, {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for size in map(int, a.sizes.split(",")):
            data_dir = tmp / f"prepared{size}"
            prepare(P.DataParams(image_size=size, channels=a.channels), data_dir)
            for preset in a.presets.split(","):
                nparams, flops = train_flops_per_image(preset, size, a.channels)
                name = f"{preset}@{size}px"
                rows[name] = {"preset": preset, "image_size": size, "params": nparams, "train_gflops_per_image": flops / 1e9}
                cfg = SimpleNamespace(image_size=size, channels=a.channels, preset=preset, batch=a.batch,
                                      steps=a.steps, device=a.device, precision=a.precision)
                loops[name] = DdpmreproLoop(bench_params(cfg, "uniform", total), train_paths(tmp, data_dir))
        # Rows by preset, then size (data is prepared per size, so they were built the other way).
        presets = a.presets.split(",")
        order = sorted(rows, key=lambda n: (presets.index(rows[n]["preset"]), rows[n]["image_size"]))
        rows, loops = {n: rows[n] for n in order}, {n: loops[n] for n in order}
        reference = order[0]

        def progress(r, times):
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {1e3 * w / a.steps:.0f} ms/step"
                                                            for m, (w, _) in times.items()), flush=True)

        timing = paired_rounds({m: (lambda loop=loop: loop.run(a.steps)) for m, loop in loops.items()}, reference,
                               a.rounds, warmup=a.warmup, seed=a.seed, sync=cuda_sync(a.device), progress=progress)
        for loop in loops.values():
            loop.finish()
    ref_flops = rows[reference]["train_gflops_per_image"]
    for name, r in rows.items():
        step_s = timing["wall_s"][name]["median"] / a.steps
        ips = a.batch / step_s
        achieved = r["train_gflops_per_image"] * 1e9 * ips
        r.update({"images_per_sec": ips, "step_seconds": step_s, "achieved_tflops": achieved / 1e12,
                  "flop_ratio_vs_first": r["train_gflops_per_image"] / ref_flops,
                  "step_time_ratio_vs_first": timing["ratio_wall"][name],
                  "mfu": achieved / (a.peak_tflops * 1e12) if a.peak_tflops else None})
        print(f"{name:18} {r['params'] / 1e6:6.2f}M params {r['train_gflops_per_image']:8.3f} GFLOP/img "
              f"{ips:8.1f} img/s  step {step_s:.3f}s  {achieved / 1e9:7.1f} GFLOP/s  "
              f"flops x{r['flop_ratio_vs_first']:.1f}, time x {fmt_ratio(r['step_time_ratio_vs_first'])}", flush=True)
    threads = timing["before"]["torch_threads"]
    result = {
        "command": command_line("growth.py", a),
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "precision": a.precision,
        "batch": a.batch, "steps_per_block": a.steps, "threads": threads, "torch": torch.__version__,
        "machine": platform.machine(), "reference_row": reference, "rows": list(rows.values()), "timing": timing,
    }
    tag = "" if a.device == "cpu" else f"-{a.device}-{a.precision}"
    out = a.out or Path(f"benchmarks/results/growth{tag}-threads{threads}.json")
    write_result(result, out)


if __name__ == "__main__":
    main()
