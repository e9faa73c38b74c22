"""Model FLOPs utilisation of the training step: how much of the card the step uses.

    PYTHONPATH=src python benchmarks/mfu.py --device cuda --precision bf16 \
        --presets ddpm-cifar10,iddpm-cifar10 --batches 128,512                # on a GPU (benchmarks/on_gpu.sh)
    PYTHONPATH=src python benchmarks/mfu.py --presets tiny --image-size 8 --channels 1 \
        --batches 4,8 --steps 1 --rounds 2 --threads 1                         # the script itself, on a CPU

For each (preset, batch): the FLOPs of one training step, counted by `torch.utils.flop_counter`
over the real training loss (the preset's diffusion from configs/<preset>.yaml: its learned
variance and hybrid loss for iddpm-cifar10), forward and backward, not by hand; the step's time,
ddpmrepro's own loop (`training.loop.train()`, introspection off) in benchmarks/timing.py's paired
rounds, and with --profile-steps, what the step's time goes to (kernels by kind on a GPU:
convolutions, GroupNorm, attention, the optimizer, ...; aten ops' CPU time on a CPU); and the device's matrix rate, measured in the same run by one large GEMM at the training
precision (`matmul_tflops`). MFU = step FLOPs / step time / that rate: the share of what this
card, at this moment, does on the operation convolutions and attention are made of. A datasheet
peak (`--peak-tflops`, dense, e.g. 989 for an H100 SXM at bf16) gives the MFU against it too.
Writes benchmarks/results/mfu[-<device>-<precision>]-threads<N>.json.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from ddpmrepro import params as P
from ddpmrepro.data import prepare
from ddpmrepro.model.diffusion import from_params as diffusion_from_params
from ddpmrepro.model.unet import PRESETS, build_unet

from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import paired_rounds
from train_step import DdpmreproLoop, bench_params, cuda_sync, train_paths

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def preset_diffusion(preset: str) -> dict:
    """The `diffusion:` section the preset is trained with (configs/<preset>.yaml), or the defaults."""
    path = ROOT / "configs" / f"{preset}.yaml"
    return yaml.safe_load(path.read_text()).get("diffusion", {}) if path.is_file() else {}


def step_flops(params: P.Params, *, image_size: int, channels: int, batch: int,
               num_classes: int = 10) -> tuple[int, int]:
    """(FLOPs of one training step's forward and backward at `batch`, the model's parameters): torch's FlopCounterMode over
    `training_losses` of the params' diffusion, on the CPU at a batch of 2: the count is linear in
    the batch, which the tests check). The optimizer and the EMA, a few FLOPs per parameter, are not
    in it, as in the MFU of the papers."""
    torch.manual_seed(0)
    model = build_unet(params.model, image_size=image_size, in_channels=channels, num_classes=num_classes,
                       learn_sigma=params.diffusion.variance == "learned_range")
    diffusion = diffusion_from_params(params.diffusion)
    n = 2
    x0 = torch.rand(n, channels, image_size, image_size) * 2 - 1
    t = torch.tensor([1, diffusion.num_timesteps - 1])
    y = torch.arange(n) % num_classes
    with FlopCounterMode(display=False) as counter:
        losses = diffusion.training_losses(lambda x, tt: model(x, tt, y), x0, t, noise=torch.randn_like(x0))
        losses["loss"].mean().backward()
    return counter.get_total_flops() * batch // n, sum(p.numel() for p in model.parameters())


# What limits the step (issue 38 item 3): the profiled time by kind of work. On a GPU the kernels'
# own device time by kernel name (cuDNN/CUTLASS names included); on a CPU each aten op's self time.
# First match wins; the rest is "other".
CATEGORIES = (
    # the autograd engine's nodes: their self time is bookkeeping, the work is in the ops they call
    ("autograd", r"^autograd::|Backward0$|AccumulateGrad"),
    ("attention", r"flash|fmha|attention|sdpa|softmax|scaled_dot_product"),
    ("convolution", r"conv|cudnn|implicit_gemm|xmma_fprop|dgrad|wgrad|winograd"),
    # ATen's GroupNorm kernels on CUDA (the UNet has no other normalisation, so its moments are these)
    ("group norm", r"group_norm|groupnorm|GroupNorm|RowwiseMoments|ComputeFusedParams|ComputeInternalGradients|"
                   r"ComputeBackwardFusedParams|GammaBetaBackward"),
    ("optimizer", r"adam|multi_tensor_apply|_foreach_"),
    ("matmul", r"gemm|addmm|\bmm\b|aten::mm|matmul|cutlass|linear|bmm"),
    ("elementwise", r"elementwise|vectorized|unrolled|aten::(add|mul|sub|div|silu|sigmoid|copy_|fill_|where|lerp)"),
    ("reduction", r"reduce|aten::(sum|mean|norm|linalg_vector_norm)"),
)


def time_by_category(prof, device: str, steps: int) -> dict:
    """{category: {"ms_per_step", "share"}} from a finished torch.profiler run of `steps` steps: the
    kernels' device time on a GPU, the aten ops' self CPU time on a CPU, sorted by time."""
    import re

    patterns = [(name, re.compile(rx, re.I)) for name, rx in CATEGORIES]
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        if device == "cuda":
            us = getattr(e, "self_device_time_total", 0.0) if str(e.device_type).endswith("CUDA") else 0.0
        else:
            us = e.self_cpu_time_total if e.key.startswith(("aten::", "autograd::")) or e.key.endswith(
                ("Backward0", "AccumulateGrad")) else 0.0
        if us <= 0:
            continue
        category = next((name for name, rx in patterns if rx.search(e.key)), "other")
        totals[category] = totals.get(category, 0.0) + us
    whole = sum(totals.values()) or 1.0
    return {c: {"ms_per_step": us / 1e3 / steps, "share": us / whole}
            for c, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def profile_categories(loop, device: str, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = cuda_sync(device)
    sync()
    with profile(activities=activities) as prof:
        loop.run(steps)
        sync()
    return time_by_category(prof, device, steps)


def matmul_tflops(device: str, precision: str, n: int = 8192, seconds: float = 1.0) -> dict:
    """The device's rate on one (n x n) @ (n x n) matmul at the training precision (fp32 -> TF32 off),
    repeated for about `seconds` after a warm-up: 2 n^3 FLOPs each. On a CPU, n is capped at 1024."""
    n = n if device == "cuda" else min(n, 1024)
    dtype = DTYPES[precision] if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = cuda_sync(device)
    a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        reps += 1
        if reps % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    del c
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "reps": reps, "seconds": elapsed,
            "tflops": 2 * n ** 3 * reps / elapsed / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="ddpm-cifar10,iddpm-cifar10", help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--batches", default="128,512", help="comma-separated batch sizes per step")
    ap.add_argument("--steps", type=int, default=10, help="training steps per timed block")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=tuple(DTYPES))
    ap.add_argument("--compile", default="none", choices=("none", "blocks"), help="train.compile")
    ap.add_argument("--cuda-graphs", action="store_true", help="train.cuda_graphs (on a CPU: its code, no capture)")
    ap.add_argument("--channels-last", action="store_true", help="train.channels_last: weights and images in NHWC")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="a datasheet peak, for a second MFU (0: none)")
    ap.add_argument("--profile-steps", type=int, default=0, help="then profile this many steps of each row: the "
                    "time by kind of work (kernels on a GPU); 0: no profile")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    total = (a.warmup + a.rounds) * a.steps + a.profile_steps
    gemm_before = matmul_tflops(a.device, a.precision)
    rows, loops = {}, {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data_dir = tmp / "prepared"
        prepare(P.DataParams(image_size=a.image_size, channels=a.channels), data_dir)
        for preset in a.presets.split(","):
            for batch in map(int, a.batches.split(",")):
                cfg = SimpleNamespace(image_size=a.image_size, channels=a.channels, preset=preset, batch=batch,
                                      steps=a.steps, device=a.device, precision=a.precision)
                raw = bench_params(cfg, "uniform", total, compile=a.compile, cuda_graphs=a.cuda_graphs,
                                   channels_last=a.channels_last).to_dict()
                raw["diffusion"] = {**raw["diffusion"], **preset_diffusion(preset)}
                raw["sample"]["respacing"] = ""  # any T: sampling is not run here
                params = P.from_dict(raw)
                name = f"{preset}/b{batch}"
                flops, nparams = step_flops(params, image_size=a.image_size, channels=a.channels, batch=batch)
                rows[name] = {"preset": preset, "batch": batch, "params": nparams, "diffusion": raw["diffusion"],
                              "gflops_per_step": flops / 1e9}
                loops[name] = DdpmreproLoop(params, train_paths(tmp, data_dir))
        reference = next(iter(rows))
        timing = paired_rounds({m: (lambda loop=loop: loop.run(a.steps)) for m, loop in loops.items()}, reference,
                               a.rounds, warmup=a.warmup, seed=a.seed, sync=cuda_sync(a.device))
        for name, loop in loops.items():
            if a.profile_steps:  # after the timing, which the profiler would slow
                rows[name]["time_by_category"] = profile_categories(loop, a.device, a.profile_steps)
                print(f"{name}: " + ", ".join(f"{c} {100 * v['share']:.0f}%" for c, v in
                                              rows[name]["time_by_category"].items()), flush=True)
            loop.finish()
    gemm_after = matmul_tflops(a.device, a.precision)
    rate = (gemm_before["tflops"] + gemm_after["tflops"]) / 2
    for name, r in rows.items():
        per_round = [w / a.steps for w in timing["wall_s"][name]["per_round"]]
        step_s = timing["wall_s"][name]["median"] / a.steps
        achieved = [r["gflops_per_step"] / 1e3 / s for s in per_round]  # TFLOP/s per round
        r.update({"step_seconds": step_s, "images_per_sec": r["batch"] / step_s,
                  "achieved_tflops": r["gflops_per_step"] / 1e3 / step_s,
                  "mfu_vs_gemm": r["gflops_per_step"] / 1e3 / step_s / rate,
                  "mfu_vs_gemm_range": [min(achieved) / rate, max(achieved) / rate],
                  "mfu_vs_peak": r["gflops_per_step"] / 1e3 / step_s / a.peak_tflops if a.peak_tflops else None})
        print(f"{name:22} {r['gflops_per_step']:10.1f} GFLOP/step  {1e3 * step_s:8.1f} ms/step  "
              f"{r['achieved_tflops']:8.3f} TFLOP/s  MFU {100 * r['mfu_vs_gemm']:5.1f}% of the GEMM's "
              f"{rate:.2f} TFLOP/s" + (f", {100 * r['mfu_vs_peak']:.1f}% of {a.peak_tflops:g}" if a.peak_tflops else ""),
              flush=True)
    threads = timing["before"]["torch_threads"]
    result = {
        "command": command_line("mfu.py", a),
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "precision": a.precision,
        "torch": torch.__version__, "machine": platform.machine(), "threads": threads,
        "gemm": {"before": gemm_before, "after": gemm_after, "tflops": rate}, "peak_tflops": a.peak_tflops or None,
        "steps_per_block": a.steps, "compile": a.compile, "cuda_graphs": a.cuda_graphs,
        "channels_last": a.channels_last, "rows": list(rows.values()),
        "timing": timing,
    }
    tag = "" if a.device == "cpu" else f"-{a.device}-{a.precision}"
    tag += "-graphs" if a.cuda_graphs else ""
    tag += "-cl" if a.channels_last else ""
    write_result(result, a.out or Path(f"benchmarks/results/mfu{tag}-threads{threads}.json"))


if __name__ == "__main__":
    main()
