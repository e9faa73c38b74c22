"""Training speed: ddpmrepro's loop against a minimal hand-written PyTorch loop and diffusers.

    PYTHONPATH=src python benchmarks/train_step.py --threads 1     # CPU: tiny UNet, digits 8x8, batch 128
    PYTHONPATH=src python benchmarks/train_step.py                 # the same at torch's default thread count
    PYTHONPATH=src python benchmarks/train_step.py --quick         # a minute or two
    PYTHONPATH=src python benchmarks/train_step.py --device cuda --preset ddpm-cifar10 --image-size 32 \
        --channels 3 --precision bf16                              # the paper model on a GPU

Contenders, all training the same UNet on the same prepared data with the same batch and the
same optimizer settings (AdamW with ddpmrepro's lr, weight decay 0, a per-step lr, grad clipping
at 1.0, one EMA):
  ddpmrepro     `ddpmrepro.training.loop.train()` itself, introspection off, uniform timesteps: everything the
                pipeline does per step (per-example seeded draws, EMA, loss statistics, a dvclive log
                line per block). One run for the whole benchmark, paused after every block.
  ddpmrepro+is  the same with IDDPM's loss-second-moment importance sampler (the default)
  ddpmrepro+ogn the same with `output-grad-norm` (the output layer's per-example gradient norms, hooks)
  plain         what one writes by hand: random batch, q_sample, MSE, backward, clip, AdamW, EMA lerp
  diffusers     diffusers' UNet2DModel configured with the same channels, blocks and attention, trained
                with DDPMScheduler.add_noise in the plain loop (needs `pip install -e .[bench]`)
  improved-diffusion  improved-diffusion's own UNetModel (the `improved-diffusion-for-SMLM` test extra)
                with the same channels, blocks, heads and AdaGN, in the plain loop: the reference
                implementation a researcher would otherwise run
  ddpmrepro+compile, plain+compile  the same with `train.compile: blocks` (runtime/compilation.py:
                each residual and attention block's forward through torch.compile). The first block
                of each (compilation, or Inductor's cache) is timed on its own: `first_block_s`.
  ddpmrepro+graphs  `train.cuda_graphs` (training/cuda_graphs.py): each microbatch's forward and
                backward replayed from a CUDA graph (on a CPU, the same code without capture);
                `+graphs+compile` with compiled blocks inside the graph. Suffixes combine:
                `ddpmrepro+is+graphs`.
  ddpmrepro+cl, plain+cl  the model and its images in NHWC (`train.channels_last`; the plain loop
                converts its model and each batch), the layout cuDNN's bf16 convolutions prefer.
Timing: benchmarks/timing.py's paired rounds (each round one block of --steps steps of every
contender in random order; ratios per round against `plain`). Target: ddpmrepro / plain step time
<= 1.05. Writes benchmarks/results/train_step[-<device>-<preset>-<precision>]-threads<N>.json.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from greenlet import greenlet

import ddpmrepro.training.loop as ddpm_train
from ddpmrepro import params as P
from ddpmrepro.data import load_prepared, prepare, to_model_range
from ddpmrepro.model.unet import PRESETS, build_unet
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import fmt_ratio, paired_rounds, verdict

TARGET = 1.05


def width(a) -> dict:
    """--model-channels as a model override ({} for the preset's width, and for callers without it)."""
    channels = getattr(a, "model_channels", 0)
    return {"channels": channels} if channels else {}


def model_params(a) -> P.ModelParams:
    return P.ModelParams(preset=a.preset, **width(a))


def architecture(a) -> dict:
    """The preset's architecture with --model-channels applied (what every contender builds)."""
    return {**PRESETS[a.preset], **width(a)}


# a ddpmrepro mode's suffix -> its timestep sampler (`ddpmrepro+is`, `ddpmrepro+ogn`)
SAMPLER_OF_MODE = {"is": "loss-second-moment", "ogn": "output-grad-norm"}


def bench_params(a, sampler: str, total_steps: int, compile: str = "none", cuda_graphs: bool = False,
                 channels_last: bool = False) -> P.Params:
    """ddpmrepro's params for the benchmark: default training recipe, introspection and checkpoints
    off, no lr warm-up (the plain loop has none), one dvclive log line per measured block.

    The post-hoc EMA is tracked (its two averages are updated every step, as in every run), but its
    one snapshot is at the last step, after the timed blocks: a run writes 32 snapshots whatever
    its length, so a benchmark run of 18-80 steps would write them on 40-100% of its steps (two
    files of the weights each time, 2 x 40 ms at 8.95M parameters) where a run of 1,500 steps
    writes them on 2% (docs/POSTHOC_EMA.md, "What it costs")."""
    return P.from_dict({
        "data": {"image_size": a.image_size, "channels": a.channels},
        "model": {"preset": a.preset, **width(a)},
        "train": {"steps": total_steps, "batch_per_proc": a.batch, "device": a.device, "precision": a.precision,
                  "timestep_sampler": sampler, "warmup_steps": 0, "log_every": a.steps,
                  "checkpoint_every": total_steps, "keep_checkpoints": 1, "compile": compile,
                  "cuda_graphs": cuda_graphs, "channels_last": channels_last,
                  "posthoc_ema_snapshots": 1},
        "introspect": {"every": 0, "steps": []},
    })


def ddpmrepro_params(a, mode: str, total_steps: int) -> P.Params:
    """A ddpmrepro mode's params from its suffixes: `ddpmrepro+is+graphs+compile`."""
    flags = set(mode.split("+")[1:])
    unknown = flags - {*SAMPLER_OF_MODE, "compile", "graphs", "cl"}
    if unknown:
        raise SystemExit(f"--modes: {mode!r} has unknown suffixes {sorted(unknown)}")
    samplers = [SAMPLER_OF_MODE[f] for f in flags if f in SAMPLER_OF_MODE]
    return bench_params(a, samplers[0] if samplers else "uniform", total_steps,
                        compile="blocks" if "compile" in flags else "none", cuda_graphs="graphs" in flags,
                        channels_last="cl" in flags)


class DdpmreproLoop:
    """`ddpmrepro.training.loop.train()` run once as a coroutine (a greenlet, on the caller's own OS thread,
    so the same OpenMP team and signal handlers) that pauses after every `steps` training steps.

    The model, optimizer and data are built once, in the first (warm-up) block, and every later
    block continues the same run: no rebuild or re-warm per block. The pause point is train.py's
    per-step `_agree` call (after the EMA update): the log and checkpoint code of a block's last
    step run at the start of the next block, so every measured block holds exactly one log line.
    train() keeps its signal handling: the first Ctrl-C asks it to stop at the end of a step (of
    whichever run is going), the second leaves at once.
    """

    _current: dict = {}  # greenlet -> loop, for the step hook

    def __init__(self, params: P.Params, paths):
        self.params, self.paths = params, paths
        self.steps_left = 0
        self.steps_done = 0
        self.summary: dict | None = None
        self._glet = greenlet(lambda: ddpm_train.train(params, paths, restart=True))
        self._current[self._glet] = self

    @classmethod
    def _hook(cls, original):
        def agree(flag):
            loop = cls._current.get(greenlet.getcurrent())
            if loop is not None:
                loop.steps_done += 1
                loop.steps_left -= 1
                if loop.steps_left == 0:
                    loop._glet.parent.switch()
            return original(flag)
        return agree

    def run(self, steps: int) -> None:
        """Runs the next `steps` steps of the training run and pauses."""
        if self._glet.dead:
            raise RuntimeError("the training run has already finished")
        self._resume(steps)

    def finish(self) -> dict:
        """Runs the remaining steps (none, if the run was sized to the blocks) and the export."""
        self.summary = self._resume(-1)  # -1: never pauses again
        self._current.pop(self._glet, None)
        if not self._glet.dead:
            raise RuntimeError("the training run did not finish")
        return self.summary

    def _resume(self, steps: int):
        self.steps_left = steps
        original = ddpm_train._agree
        ddpm_train._agree = self._hook(original)  # only while this run runs
        try:
            return self._glet.switch()
        finally:
            ddpm_train._agree = original


def train_paths(tmp: Path, data_dir: Path):
    run = Path(tempfile.mkdtemp(dir=tmp))
    return ddpm_train.TrainPaths(data_dir, run / "model", run / "live", run / "introspect", run / "ckpt")


class PlainLoop:
    """The loop a researcher writes by hand, on the same UNet (or diffusers' UNet2DModel), with
    ddpmrepro's optimizer settings: AdamW(lr, weight_decay=0), lr set every step, clip at 1.0."""

    def __init__(self, a, p: P.TrainParams, data_dir: Path, model: str, total_steps: int):
        self.a, self.p, self.total_steps = a, p, total_steps
        self.device = torch.device(a.device)
        d = load_prepared(data_dir)
        self.images = torch.as_tensor(d.train_images).to(self.device)
        self.labels = torch.as_tensor(d.train_labels, dtype=torch.long).to(self.device)
        self.num_classes = d.manifest["num_classes"]
        torch.manual_seed(0)
        builders = {"plain": lambda: build_unet(model_params(a), image_size=a.image_size, in_channels=a.channels,
                                                num_classes=self.num_classes, learn_sigma=False),
                    "diffusers": lambda: diffusers_unet(a, self.num_classes),
                    "improved-diffusion": lambda: improved_diffusion_unet(a, self.num_classes)}
        base, *flags = model.split("+")
        if set(flags) - {"compile", "cl"}:
            raise SystemExit(f"--modes: {model!r} has unknown suffixes {sorted(set(flags) - {'compile', 'cl'})}")
        self.model = builders[base]().to(self.device).train()
        self.layout = torch.channels_last if "cl" in flags else torch.contiguous_format
        self.model.to(memory_format=self.layout)
        if "compile" in flags:
            from ddpmrepro.runtime.compilation import compile_blocks

            compile_blocks(self.model)
        self.diffusers = base == "diffusers"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=p.lr, weight_decay=p.weight_decay,
                                     **({"fused": True} if self.device.type == "cuda" else {"foreach": True}))
        self.resolve_params()
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=a.precision == "fp16")
        self.n = 0
        if self.diffusers:
            from diffusers import DDPMScheduler

            self.scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
        else:  # the cosine schedule of Nichol & Dhariwal, by hand
            s = torch.linspace(0, 1, 1001, dtype=torch.float64)
            f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
            self.alpha_bar = torch.cumprod(1 - betas, 0).float().to(self.device)

    def resolve_params(self) -> None:
        """A careful hand-written loop walks the parameters once, not per step (a walk of the tiny
        UNet's 183 tensors costs ~0.35 ms; ddpmrepro's EMA resolves its tensors once too). Call
        again after changing the model's storage (`.to(memory_format=...)`)."""
        self.params = list(self.model.parameters())
        self.live = [q.detach() for q in self.params]
        self.ema = [q.clone() for q in self.live]

    def step(self) -> None:
        B = self.a.batch
        idx = torch.randint(len(self.images), (B,), device=self.device)
        x0 = to_model_range(self.images[idx]).contiguous(memory_format=self.layout)
        y = self.labels[idx]
        y = torch.where(torch.rand(B, device=self.device) < self.p.label_dropout, torch.full_like(y, self.num_classes), y)
        t = torch.randint(0, 1000, (B,), device=self.device)
        noise = torch.randn_like(x0)
        for group in self.opt.param_groups:  # linear anneal, as ddpmrepro's default
            group["lr"] = self.p.lr * max(0.0, 1.0 - self.n / self.total_steps)
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
        torch.nn.utils.clip_grad_norm_(self.params, self.p.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.live, 1 - self.p.ema_rates[0])
        self.n += 1

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def diffusers_unet(a, num_classes: int):
    """diffusers' UNet2DModel with ddpmrepro's preset: same widths, res blocks, attention levels, heads."""
    from diffusers import UNet2DModel

    cfg = architecture(a)
    widths = tuple(cfg["channels"] * m for m in cfg["channel_mult"])
    attn = [a.image_size // 2**i in cfg["attention_resolutions"] for i in range(len(widths))]
    return UNet2DModel(
        sample_size=a.image_size, in_channels=a.channels, out_channels=a.channels,
        layers_per_block=cfg["num_res_blocks"], block_out_channels=widths,
        down_block_types=tuple("AttnDownBlock2D" if at else "DownBlock2D" for at in attn),
        up_block_types=tuple("AttnUpBlock2D" if at else "UpBlock2D" for at in reversed(attn)),
        num_class_embeds=num_classes + 1, attention_head_dim=cfg["num_head_channels"], dropout=cfg["dropout"],
        resnet_time_scale_shift="scale_shift" if cfg["scale_shift_norm"] else "default",
        # Without it diffusers gives the middle attention no GroupNorm under scale_shift: 64 parameters
        # fewer than ours for `tiny` (ddpmrepro.interop.diffusers_unet maps the two exactly).
        attn_norm_num_groups=32,
    )


def improved_diffusion_unet(a, num_classes: int):
    """improved-diffusion's UNetModel with ddpmrepro's preset: same widths, res blocks, attention
    levels (as downsampling rates), heads, AdaGN and dropout; a label table with the null row too."""
    from improved_diffusion_for_SMLM.improved_diffusion.unet import UNetModel

    cfg = architecture(a)
    widths = [cfg["channels"] * m for m in cfg["channel_mult"]]
    heads = max(1, min(widths) // cfg["num_head_channels"])  # ours: channels // head channels per level
    if any(w // cfg["num_head_channels"] not in (0, 1, heads) for w in widths):
        raise SystemExit("improved-diffusion has one head count for all levels; this preset's differ")
    return UNetModel(a.channels, cfg["channels"], a.channels, cfg["num_res_blocks"],
                     tuple(a.image_size // r for r in cfg["attention_resolutions"]), dropout=cfg["dropout"],
                     channel_mult=tuple(cfg["channel_mult"]), num_classes=num_classes + 1, num_heads=heads,
                     use_scale_shift_norm=cfg["scale_shift_norm"])


def cuda_sync(device: str):
    return (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 64, 10 rounds")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--model-channels", type=int, default=0, help="the preset's base width instead (0: the preset's)")
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="training steps per block (and ddpmrepro's log_every)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of one block per contender, in random order")
    ap.add_argument("--warmup", type=int, default=2, help="untimed blocks per contender before the rounds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--modes", default="ddpmrepro,ddpmrepro+is,plain,diffusers")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batch, a.rounds = 64, 10
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    if "plain" not in modes:
        ap.error("--modes must include plain (the reference)")
    if "diffusers" in modes:
        try:
            import diffusers  # noqa: F401
        except ImportError:
            print("diffusers is not installed (pip install -e .[bench]); skipping that mode")
            modes.remove("diffusers")
    total = (1 + a.warmup + a.rounds) * a.steps
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data_dir = tmp / "prepared"
        prepare(P.DataParams(image_size=a.image_size, channels=a.channels), data_dir)
        ours = {m: DdpmreproLoop(ddpmrepro_params(a, m, total), train_paths(tmp, data_dir))
                for m in modes if m.startswith("ddpmrepro")}
        p = bench_params(a, "uniform", total).train
        plain = {m: PlainLoop(a, p, data_dir, m, total) for m in modes if not m.startswith("ddpmrepro")}
        loops = {**ours, **plain}
        # The first block alone: compilation (or Inductor's on-disk cache) happens in it.
        first_block_s = {}
        for m, loop in loops.items():
            t0 = time.perf_counter()
            loop.run(a.steps)
            cuda_sync(a.device)()
            first_block_s[m] = time.perf_counter() - t0
            print(f"first block of {m}: {first_block_s[m]:.1f} s", flush=True)

        def progress(r, times):
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {a.steps * a.batch / w:.0f} img/s"
                                                            for m, (w, _) in times.items()), flush=True)

        timing = paired_rounds({m: (lambda loop=loop: loop.run(a.steps)) for m, loop in loops.items()}, "plain",
                               a.rounds, warmup=a.warmup, seed=a.seed, sync=cuda_sync(a.device), progress=progress)
        steps_run = {m: loop.finish()["step"] for m, loop in ours.items()}
        nparams = {m: sum(q.numel() for q in loop.model.parameters()) for m, loop in plain.items()}
    if any(s != total for s in steps_run.values()):
        raise RuntimeError(f"ddpmrepro ran {steps_run} steps, expected {total}")
    threads = timing["before"]["torch_threads"]
    ratio = timing["ratio_wall"]
    result = {
        "command": command_line("train_step.py", a, skip=("quick", "out")),
        "preset": a.preset, "image": [a.channels, a.image_size, a.image_size], "batch": a.batch,
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "precision": a.precision,
        "threads": threads, "torch": torch.__version__, "machine": platform.machine(), "params": nparams,
        "steps_per_block": a.steps, "model_channels": architecture(a)["channels"],
        "first_block_s": first_block_s, "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "images_per_sec": {m: a.steps * a.batch / s["median"] for m, s in timing["wall_s"].items()},
        "step_time_ratio_vs_plain": {m: ratio[m] for m in loops},
        "target": {"what": f"ddpmrepro / plain step time <= {TARGET}", "ratio": TARGET,
                   "verdict": {m: verdict(ratio[m], TARGET) for m in ours}},
        "timing": timing,
    }
    tag = "" if (a.device, a.preset) == ("cpu", "tiny") else f"-{a.device}-{a.preset}-{a.precision}"
    tag += f"-ch{a.model_channels}" if a.model_channels else ""
    out = a.out or Path(f"benchmarks/results/train_step{tag}{'-quick' if a.quick else ''}-threads{threads}.json")
    write_result(result, out)
    load = timing["before"]["load_avg"][0], timing["after"]["load_avg"][0]
    print(f"{a.preset} {a.channels}x{a.image_size}x{a.image_size}, batch {a.batch}, {a.device} {a.precision}, "
          f"{threads} threads, {a.rounds} rounds of {a.steps}-step blocks, load {load[0]:.2f} -> {load[1]:.2f}")
    for m in loops:
        print(f"  {m:13} {result['images_per_sec'][m]:7.0f} img/s  step time / plain: wall {fmt_ratio(ratio[m])}"
              f"  cpu {timing['ratio_cpu'][m]['median']:.3f}")
    for m, v in result["target"]["verdict"].items():
        print(f"  target {m} <= {TARGET}: {v}")


if __name__ == "__main__":
    main()
