"""Does capturing the training step in CUDA graphs pay, and from what batch on (issue 38, item 2)?
Measured before any capture goes into the training loop.

    PYTHONPATH=src python benchmarks/graph_step.py --device cuda --precision bf16 --batches 128,512   # on_gpu.sh "graphs"
    PYTHONPATH=src python benchmarks/graph_step.py --preset tiny --image-size 8 --channels 1 --batches 8 \
        --modes eager --steps 2 --rounds 2 --threads 1                          # the script itself, on a CPU

One training step as benchmarks/train_step.py's plain loop takes it (q_sample on the cosine
schedule, eps MSE under autocast, backward, clipping at 1.0, AdamW, one EMA), on the preset's
UNet, reading its batch from static buffers (x0, labels, t, noise) that are refilled on the
device before each step, as the read-ahead thread would deliver a batch. Three ways to run it:

  eager    as written: about 2,400 kernel launches a step from Python (notes/gpu-step.md)
  graph    the whole step (forward, backward, clipping, fused capturable AdamW with its lr a
           device tensor, the EMA) captured once in a torch.cuda.CUDAGraph and replayed: one
           launch a step
  compile  torch.compile(model, mode="reduce-overhead"): Inductor's kernels in CUDA graph trees,
           the optimizer and the EMA eager
  +cl      any of them with the model and its inputs in channels_last (NHWC), the layout cuDNN's
           bf16 convolutions prefer on recent cards (issue 38, item 3: measured before an option).
           Dropout draws its mask in memory order, so +cl trains with other masks than eager:
           its agreement is that of another draw, not of rounding (tiny, CPU: 3.7e-4 of the
           weights after 3 steps that moved them 7.7e-4)

Before the timing, each is checked against eager: the same 3 steps from the same weights on the
same batches; `agreement` is the relative difference of all the weights after them, and of the
worst tensor, read against how far eager's weights moved in those steps (graph replays eager's
kernels, so it should be at rounding level; bf16 and Inductor's kernels are not bitwise eager's;
compile draws dropout from torch's generator, `fallback_random`, as `train.compile` does). On
the CPU, eager at 2 threads against 1 differs by 1.4e-8 of the weights after moving 7.7e-4 (tiny). Timing: benchmarks/timing.py's paired rounds, ratios against eager.
Writes benchmarks/results/graph_step[-<device>-<precision>].json.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import platform
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ddpmrepro import params as P
from ddpmrepro.model.unet import PRESETS, build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import fmt_ratio, paired_rounds
from train_step import cuda_sync

MODES = ("eager", "graph", "compile", "eager+cl", "graph+cl", "compile+cl")
LR, CLIP, EMA_RATE, CHECK_STEPS = 1e-4, 1.0, 0.9999, 3
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def cosine_alpha_bar(device: torch.device, T: int = 1000) -> torch.Tensor:
    s = torch.linspace(0, 1, T + 1, dtype=torch.float64)
    f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.cumprod(1 - (1 - f[1:] / f[:-1]).clamp(max=0.999), 0).float().to(device)


def batches(n: int, batch: int, channels: int, size: int, device: torch.device) -> list[dict]:
    """n batches drawn once, on the device: the step copies one into its static buffers."""
    g = torch.Generator().manual_seed(1)
    return [{"x0": (torch.rand(batch, channels, size, size, generator=g) * 2 - 1).to(device),
             "y": torch.randint(0, 10, (batch,), generator=g).to(device),
             "t": torch.randint(0, 1000, (batch,), generator=g).to(device),
             "noise": torch.randn(batch, channels, size, size, generator=g).to(device)} for _ in range(n)]


class Step:
    """One contender: the model, its optimizer and EMA, the static batch buffers, and `step(lr)`."""

    def __init__(self, mode: str, model: torch.nn.Module, data: list[dict], precision: str):
        self.mode, self.data, self.i = mode, data, 0
        self.kind, self.channels_last = mode.split("+")[0], mode.endswith("+cl")
        self.device = next(model.parameters()).device
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.train()
        self.params = list(model.parameters())
        self.ema = [p.detach().clone() for p in self.params]
        self.live = [p.detach() for p in self.params]
        self.dtype = DTYPES[precision]
        self.alpha_bar = cosine_alpha_bar(self.device)
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        self.static = {k: v.clone(memory_format=layout) if v.dim() == 4 else v.clone() for k, v in data[0].items()}
        cuda = self.device.type == "cuda"
        if self.kind == "graph":  # capturable: the step count and the lr live on the device
            self.lr = torch.tensor(LR, device=self.device)
            self.opt = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0, fused=True, capturable=True)
        else:
            self.lr = LR
            self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0,
                                         **({"fused": True} if cuda else {"foreach": True}))
        if self.kind == "compile":
            # dropout's masks from torch's generator, as eager draws them (and as train.compile does)
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True
        self.net = torch.compile(model, mode="reduce-overhead") if self.kind == "compile" else model
        self.graph = None
        self.warm()

    def body(self) -> torch.Tensor:
        s = self.static
        # the autocast cache would hold casts of the weights across replays: off, as torch.cuda.graphs asks
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None, cache_enabled=False):
            ab = self.alpha_bar[s["t"]].view(-1, 1, 1, 1)
            out = self.net(ab.sqrt() * s["x0"] + (1 - ab).sqrt() * s["noise"], s["t"], s["y"])
        loss = F.mse_loss(out.float(), s["noise"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)  # foreach, no host sync
        self.opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.live, 1 - EMA_RATE)
        return loss

    def set_lr(self, lr: float) -> None:
        if isinstance(self.lr, torch.Tensor):
            self.lr.fill_(lr)
        else:
            for group in self.opt.param_groups:
                group["lr"] = lr

    def warm(self) -> None:
        """Warm-up steps at lr 0 (the weights and the EMA stay as they are), the capture for
        `graph`, then the optimizer's state back to a fresh one, so that every contender starts
        the agreement check from the same state."""
        self.set_lr(0.0)
        side = torch.cuda.Stream() if self.device.type == "cuda" else None
        if side is not None:  # warm-up on a side stream, as torch.cuda.graphs requires before a capture
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                if self.kind == "compile":
                    torch.compiler.cudagraph_mark_step_begin()
                self.body()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if self.kind == "graph":
            self.opt.zero_grad(set_to_none=True)  # the capture's backward allocates the grads in its pool
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.body()
        for state in self.opt.state.values():  # a fresh AdamW's moments and step count are zeros
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
        self.set_lr(LR)

    def step(self) -> None:
        for k, v in self.data[self.i % len(self.data)].items():
            self.static[k].copy_(v, non_blocking=True)
        self.i += 1
        if self.graph is not None:
            self.graph.replay()
            return
        self.opt.zero_grad(set_to_none=True)
        if self.kind == "compile":
            torch.compiler.cudagraph_mark_step_begin()
        self.body()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def agreement(a: Step, b: Step) -> dict:
    """How far a's weights are from b's: over all of them, ||w_a - w_b|| / ||w_b||, and the worst
    single tensor. The worst tensor can be O(1) after a few steps with no error anywhere: a weight
    whose gradient is still rounding noise (one feeding a zero-initialised layer) gets full-size
    Adam steps in the direction of that noise."""
    diff = [(pa.detach().float() - pb.detach().float()).norm() for pa, pb in zip(a.params, b.params)]
    ref = [pb.detach().float().norm() for pb in b.params]
    total = torch.stack(diff).norm() / torch.stack(ref).norm()
    worst = max((d / r.clamp_min(1e-30)).item() for d, r in zip(diff, ref))
    return {"all_weights": total.item(), "worst_tensor": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ddpm-cifar10", choices=sorted(PRESETS))
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--batches", default="128,512", help="comma-separated batch sizes")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}; eager first")
    ap.add_argument("--steps", type=int, default=20, help="training steps per timed block")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=tuple(DTYPES))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    if modes[0] != "eager" or not set(modes) <= set(MODES):
        ap.error(f"--modes: eager first, then any of {', '.join(MODES[1:])} (got {a.modes})")
    if a.device == "cpu" and any(m.startswith("graph") for m in modes):
        ap.error("--modes graph needs --device cuda (CUDA graphs)")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    tag = "" if a.device == "cpu" else f"-{a.device}-{a.precision}"
    out = a.out or Path(f"benchmarks/results/graph_step{tag}.json")
    rows = []
    for batch in map(int, a.batches.split(",")):
        torch.manual_seed(0)
        reference = build_unet(P.ModelParams(preset=a.preset), image_size=a.image_size, in_channels=a.channels,
                               num_classes=10, learn_sigma=False).to(device)
        data = batches(8, batch, a.channels, a.image_size, device)
        steps = {m: Step(m, copy.deepcopy(reference), data, a.precision) for m in modes}
        for s in steps.values():
            torch.manual_seed(2)  # the same dropout masks (CPU and CUDA generators; a graph's replay reads them too)
            s.run(CHECK_STEPS)
        cuda_sync(a.device)()
        agree = {m: agreement(steps[m], steps["eager"]) for m in modes}
        # how far eager's weights moved in those steps: the scale a difference is read against
        moved = agreement(steps["eager"], SimpleNamespace(params=list(reference.parameters())))["all_weights"]
        timing = paired_rounds({m: (lambda s=s: s.run(a.steps)) for m, s in steps.items()}, "eager", a.rounds,
                               warmup=a.warmup, seed=a.seed, sync=cuda_sync(a.device))
        row = {"batch": batch, "agreement_after_3_steps": agree, "eager_moved_after_3_steps": moved,
               "ms_per_step": {m: 1e3 * timing["wall_s"][m]["median"] / a.steps for m in modes},
               "ratio_wall_vs_eager": {m: timing["ratio_wall"][m] for m in modes}, "timing": timing}
        rows.append(row)
        for m in modes:
            print(f"batch {batch:5d} {m:8} {row['ms_per_step'][m]:9.2f} ms/step  vs eager "
                  f"{fmt_ratio(timing['ratio_wall'][m])}  weights after {CHECK_STEPS} steps: "
                  f"{agree[m]['all_weights']:.2e} of eager's (worst tensor {agree[m]['worst_tensor']:.2e}; eager "
                  f"moved {moved:.2e})", flush=True)
        del steps
        # after each batch: a part cut by on_gpu.sh's time limit keeps the batches it finished
        write_result({"command": command_line("graph_step.py", a),
                      "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
                      "precision": a.precision, "torch": torch.__version__, "machine": platform.machine(),
                      "preset": a.preset, "image_size": a.image_size, "rows": rows}, out)


if __name__ == "__main__":
    main()
