"""Gradient checkpointing (`model.grad_checkpoint`): peak memory and step time with and without it.

    PYTHONPATH=src python benchmarks/grad_checkpoint.py                     # CPU, 1 thread, 32x32 RGB
    PYTHONPATH=src python benchmarks/grad_checkpoint.py --quick             # seconds: the smallest settings

One training step = the real UNet, `GaussianDiffusion.training_losses` (hybrid loss, learned sigma),
backward and an AdamW step, at each batch size, with checkpointing off and on (same weights, same
batch, same seeds: the gradients are bitwise equal, tests/test_grad_checkpoint.py).

Memory, two measures. Activations kept for backward: the bytes autograd saves in the forward pass
(a `saved_tensors_hooks` count, storages once, parameters excluded), exact and machine-independent.
Peak memory: each (batch, on/off) step runs in a fresh process (`--child`), which reports the growth of
its peak resident set size (ru_maxrss) over one step, measured from just before the step: on CPU
torch has no allocator statistics, so this is what the operating system saw the step add
(activations kept for backward, gradients, temporaries; AdamW's moments exist before it), repeated
`--memory-repeats` times (median). On CUDA it is `torch.cuda.max_memory_allocated` over the step.
Time: benchmarks/timing.py's paired rounds, one block = `--steps` steps, ratio on/off per round.
Writes benchmarks/results/grad_checkpoint-<device>-threads<N>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

import torch

from ddpmrepro import params as P
from ddpmrepro.model.diffusion import from_params as diffusion_from_params
from ddpmrepro.model.unet import build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import fmt_ratio, paired_rounds


def make_step(a, batch: int, grad_checkpoint: bool, device: torch.device):
    """A closure running one training step, and the model (identical initial weights on/off)."""
    torch.manual_seed(0)
    mp = P.ModelParams(preset="tiny", channels=a.width, channel_mult=a.channel_mult,
                       attention_resolutions=a.attention, num_head_channels=a.width, dropout=0.1,
                       grad_checkpoint=grad_checkpoint)
    model = build_unet(mp, image_size=a.image_size, in_channels=a.channels, num_classes=10,
                       learn_sigma=True).to(device)
    diffusion = diffusion_from_params(P.DiffusionParams(variance="learned_range", loss="hybrid"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    # AdamW's moments now, with zero gradients (no weight moves): a step's memory is then the step's own.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    x0 = (torch.rand(batch, a.channels, a.image_size, a.image_size, generator=g) * 2 - 1).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    t = torch.randint(0, diffusion.num_timesteps, (batch,), generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)

    def step():
        loss = diffusion.training_losses(lambda x, tt: model(x, tt, y), x0, t, noise=noise)["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.model = model
    return step


def saved_for_backward_bytes(step) -> int:
    """Bytes that autograd keeps from the forward pass for backward (one step), storages counted
    once, parameters left out (they exist anyway). A checkpointed block's own saved tensors are
    caught by torch.utils.checkpoint's inner hooks and dropped: only its inputs count, as kept."""
    params = {p.untyped_storage().data_ptr() for p in step.model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(kept.values())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(a) -> None:
    """One step in this fresh process; prints the peak-memory growth in bytes as JSON."""
    import psutil

    device = torch.device(a.device)
    step = make_step(a, a.child_batch, a.child_checkpoint, device)
    if device.type == "cuda":
        step()  # warm up kernels and the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        grew = torch.cuda.max_memory_allocated() - base
    else:
        # The first step: ru_maxrss cannot be reset, so a warm-up step would hide this one's peak.
        base = psutil.Process().memory_info().rss
        step()
        grew = peak_rss_bytes() - base
    print(json.dumps({"bytes": grew}))


def measure_memory(a, batch: int, on: bool) -> list[int]:
    out = []
    for _ in range(a.memory_repeats):
        cmd = [sys.executable, __file__, "--child", "--child-batch", str(batch), *(["--child-checkpoint"] if on else []),
               *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1])["bytes"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--channel-mult", type=int, nargs="+", default=[1, 2, 2])
    ap.add_argument("--attention", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=1, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the smallest settings (a test runs this)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-checkpoint", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.image_size, a.width, a.channel_mult, a.attention, a.batches = 8, 32, [1, 2], [4], [2, 4]
        a.rounds, a.memory_repeats = 2, 1
    torch.set_num_threads(a.threads)
    if a.child:
        return child(a)
    device = torch.device(a.device)
    rows = []
    for batch in a.batches:
        mem = {on: measure_memory(a, batch, on) for on in (False, True)}
        steps = {on: make_step(a, batch, on, device) for on in (False, True)}
        saved = {on: saved_for_backward_bytes(steps[on]) for on in (False, True)}
        blocks = {name: (lambda s=steps[on]: [s() for _ in range(a.steps)]) for name, on in (("off", False), ("on", True))}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        timing = paired_rounds(blocks, "off", a.rounds, sync=sync)
        med = {on: sorted(v)[len(v) // 2] for on, v in mem.items()}
        row = {"batch": batch, "saved_for_backward_bytes": {"off": saved[False], "on": saved[True]},
               "saved_ratio_on_off": saved[True] / saved[False],
               "peak_growth_bytes": {"off": mem[False], "on": mem[True]},
               "peak_ratio_on_off": med[True] / med[False], "timing": timing}
        rows.append(row)
        print(f"batch {batch}: kept for backward off {saved[False] / 2**20:.1f} MiB, on {saved[True] / 2**20:.1f} MiB "
              f"({row['saved_ratio_on_off']:.3f}x); peak growth off {med[False] / 2**20:.1f} MiB, on "
              f"{med[True] / 2**20:.1f} MiB ({row['peak_ratio_on_off']:.2f}x); step time on/off "
              f"{fmt_ratio(timing['ratio_wall']['on'])}", flush=True)
    result = {
        "benchmark": "grad_checkpoint", "command": command_line("grad_checkpoint.py", a,
                                                                 skip=("out", "child", "child_batch", "child_checkpoint")),
        "device": a.device, "threads": a.threads, "torch": torch.__version__, "machine": platform.platform(),
        "model": {"width": a.width, "channel_mult": a.channel_mult, "attention": a.attention,
                  "image_size": a.image_size, "channels": a.channels, "dropout": 0.1, "learn_sigma": True},
        "memory_method": ("CUDA max_memory_allocated growth over the second step" if device.type == "cuda" else
                          "growth of ru_maxrss over the first step of a fresh process, from the RSS just before it"),
        "rows": rows,
    }
    out = a.out or Path(__file__).parent / "results" / f"grad_checkpoint-{a.device}-threads{a.threads}.json"
    write_result(result, out)


if __name__ == "__main__":
    main()
