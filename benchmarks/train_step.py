"""Training speed: ddpmrepro's loop against a minimal hand-written PyTorch loop and diffusers.

    PYTHONPATH=src python benchmarks/train_step.py                 # CPU: tiny UNet, digits 8x8, batch 128
    PYTHONPATH=src python benchmarks/train_step.py --quick         # a minute
    PYTHONPATH=src python benchmarks/train_step.py --device cuda --preset ddpm-cifar10 --image-size 32 \
        --channels 3 --precision bf16                              # the paper model on a GPU

Three loops train the same UNet on the same prepared data with the same batch:
  ddpmrepro   `ddpmrepro.train.train()` itself, introspection off, uniform timesteps: everything the
              pipeline does per step (per-example seeded draws, EMA, loss statistics, logging)
  ddpmrepro+is  the same with IDDPM's loss-second-moment importance sampler (the default)
  plain       what one writes by hand: random batch, q_sample, MSE, backward, clip, AdamW, EMA lerp
  diffusers   diffusers' UNet2DModel configured with the same channels, blocks and attention, trained
              with DDPMScheduler.add_noise in the same plain loop (needs `pip install -e .[bench]`)
Modes run interleaved (one block of each, repeated) and are compared by medians of images/s; the
target is ddpmrepro / plain <= 1.05 in step time. Writes benchmarks/results/train_step[-<tag>].json.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddpmrepro import params as P
from ddpmrepro.data import load_prepared, prepare, to_model_range
from ddpmrepro.unet import PRESETS, build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_params(a, sampler: str) -> P.Params:
    """ddpmrepro's params for the benchmark: default training recipe, introspection and checkpoints off."""
    steps = a.warmup + a.steps
    return P.from_dict({
        "data": {"image_size": a.image_size, "channels": a.channels},
        "model": {"preset": a.preset},
        "diffusion": {"schedule": "cosine"},
        "train": {"steps": steps, "batch_per_proc": a.batch, "device": a.device, "precision": a.precision,
                  "timestep_sampler": sampler, "warmup_steps": 0, "log_every": a.steps,
                  "checkpoint_every": steps, "keep_checkpoints": 1},
        "introspect": {"every": 0, "steps": []},
    })


def run_ddpmrepro(a, data_dir: Path, tmp: Path, sampler: str) -> float:
    """Images/s of the last log interval: exactly the measured steps (the warm-up is the first interval)."""
    from ddpmrepro.train import TrainPaths, train

    run = Path(tempfile.mkdtemp(dir=tmp))
    paths = TrainPaths(data_dir, run / "model", run / "live", run / "introspect", run / "ckpt")
    summary = train(bench_params(a, sampler), paths, restart=True)
    return summary["images_per_sec"]


class PlainLoop:
    """The loop a researcher writes by hand, on the same UNet (or diffusers' UNet2DModel)."""

    def __init__(self, a, data_dir: Path, model: str):
        self.a, self.device = a, torch.device(a.device if a.device != "auto" else "cpu")
        d = load_prepared(data_dir)
        self.images = torch.as_tensor(d.train_images).to(self.device)
        self.labels = torch.as_tensor(d.train_labels, dtype=torch.long).to(self.device)
        self.num_classes = d.manifest["num_classes"]
        torch.manual_seed(0)
        self.model = (build_unet(P.ModelParams(preset=a.preset), image_size=a.image_size, in_channels=a.channels,
                                 num_classes=self.num_classes, learn_sigma=False) if model == "plain"
                      else diffusers_unet(a, self.num_classes)).to(self.device).train()
        self.diffusers = model == "diffusers"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-4, foreach=True)
        self.ema = [p.detach().clone() for p in self.model.parameters()]
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=a.precision == "fp16")
        if self.diffusers:
            from diffusers import DDPMScheduler

            self.scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
        else:  # the cosine schedule of Nichol & Dhariwal, by hand
            s = torch.linspace(0, 1, 1001, dtype=torch.float64)
            f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
            self.alpha_bar = torch.cumprod(1 - betas, 0).float().to(self.device)

    def step(self) -> None:
        B = self.a.batch
        idx = torch.randint(len(self.images), (B,), device=self.device)
        x0 = to_model_range(self.images[idx])
        y = self.labels[idx]
        y = torch.where(torch.rand(B, device=self.device) < 0.1, torch.full_like(y, self.num_classes), y)
        t = torch.randint(0, 1000, (B,), device=self.device)
        noise = torch.randn_like(x0)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            if self.diffusers:
                xt = self.scheduler.add_noise(x0, noise, t)
                out = self.model(xt, t, class_labels=y).sample
            else:
                ab = self.alpha_bar[t].view(-1, 1, 1, 1)
                out = self.model(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t, y)
        loss = F.mse_loss(out.float(), noise)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.model.parameters()], 1 - 0.999)

    def images_per_sec(self, steps: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return steps * self.a.batch / (time.perf_counter() - t0)


def diffusers_unet(a, num_classes: int):
    """diffusers' UNet2DModel with ddpmrepro's preset: same widths, res blocks, attention levels, heads."""
    from diffusers import UNet2DModel

    cfg = PRESETS[a.preset]
    widths = tuple(cfg["channels"] * m for m in cfg["channel_mult"])
    attn = [a.image_size // 2**i in cfg["attention_resolutions"] for i in range(len(widths))]
    return UNet2DModel(
        sample_size=a.image_size, in_channels=a.channels, out_channels=a.channels,
        layers_per_block=cfg["num_res_blocks"], block_out_channels=widths,
        down_block_types=tuple("AttnDownBlock2D" if at else "DownBlock2D" for at in attn),
        up_block_types=tuple("AttnUpBlock2D" if at else "UpBlock2D" for at in reversed(attn)),
        num_class_embeds=num_classes + 1, attention_head_dim=cfg["num_head_channels"], dropout=cfg["dropout"],
        resnet_time_scale_shift="scale_shift" if cfg["scale_shift_norm"] else "default",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 64, 10 steps, 3 repeats")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per block")
    ap.add_argument("--warmup", type=int, default=20, help="steps before measuring (a multiple of --steps)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--modes", default="ddpmrepro,ddpmrepro+is,plain,diffusers")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batch, a.steps, a.warmup, a.repeats = 64, 10, 10, 3
    if a.warmup % a.steps:
        ap.error("--warmup must be a multiple of --steps (ddpmrepro's last log interval is the measured block)")
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    if "diffusers" in modes:
        try:
            import diffusers  # noqa: F401
        except ImportError:
            print("diffusers is not installed (pip install -e .[bench]); skipping that mode")
            modes.remove("diffusers")
    rates: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data_dir = tmp / "prepared"
        prepare(P.DataParams(image_size=a.image_size, channels=a.channels), data_dir)
        loops = {m: PlainLoop(a, data_dir, m) for m in modes if m in ("plain", "diffusers")}
        for loop in loops.values():
            loop.images_per_sec(a.warmup)
        for r in range(a.repeats):
            for m in modes:
                if m in loops:
                    rates[m].append(loops[m].images_per_sec(a.steps))
                else:
                    rates[m].append(run_ddpmrepro(a, data_dir, tmp, "uniform" if m == "ddpmrepro" else "loss-second-moment"))
            print(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{m} {v[-1]:.0f} img/s" for m, v in rates.items()),
                  flush=True)
        nparams = {m: sum(p.numel() for p in loop.model.parameters()) for m, loop in loops.items()}
    med = {m: statistics.median(v) for m, v in rates.items()}
    base = med.get("plain")
    result = {
        "command": command_line("train_step.py", a, skip=("quick", "out")),
        "preset": a.preset, "image": [a.channels, a.image_size, a.image_size], "batch": a.batch,
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "precision": a.precision,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "params": nparams, "steps_per_block": a.steps, "repeats": a.repeats,
        "images_per_sec": {m: {"median": med[m], "all": v} for m, v in rates.items()},
        "step_time_ratio_vs_plain": {m: base / med[m] for m in med} if base else None,
        "target": "ddpmrepro / plain step time <= 1.05",
    }
    tag = "" if (a.device, a.preset) == ("cpu", "tiny") else f"-{a.device}-{a.preset}-{a.precision}"
    out = a.out or Path(f"benchmarks/results/train_step{tag}{'-quick' if a.quick else ''}.json")
    write_result(result, out)
    print(f"{a.preset} {a.channels}x{a.image_size}x{a.image_size}, batch {a.batch}, {a.device} {a.precision}, "
          f"{result['threads']} threads; medians of {a.repeats} blocks of {a.steps} steps")
    for m in med:
        ratio = f"{base / med[m]:.3f}" if base else "-"
        print(f"  {m:14} {med[m]:8.1f} img/s   step time / plain {ratio}")


if __name__ == "__main__":
    main()
