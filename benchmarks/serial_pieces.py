"""The CPU cost of each piece of work ddpmrepro's training step does beyond the plain loop.

    PYTHONPATH=src python benchmarks/serial_pieces.py

Every piece is serial (Python statements, tensors of 128 or 1,000 values: below the size at which
torch's OpenMP kernels split work over threads), so its cost does not shrink with more threads
while the model's kernels do; that is how a loop's ratio to the plain loop can grow from 1 to 2
threads (docs/BENCHMARKS.md). Each piece is timed alone at 1 thread, with the main thread's CPU
time (`time.thread_time`, steadier than wall time on a shared machine): median of 5 runs of
--calls calls, batch 128, the default tiny UNet. Prints ms per call.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from ddpmrepro import params as P
from ddpmrepro.model.diffusion import from_params
from ddpmrepro.training.introspect import ActivationGradRecorder
from ddpmrepro.training.timestep_sampler import create_sampler
from ddpmrepro.training.batches import example_draws, step_seed
from ddpmrepro.model.unet import build_unet

LOG_KEYS = ("loss", "mse", "vb", "loss_q0", "loss_q1", "loss_q2", "loss_q3", "grad_norm", "lr", "loss_scale",
            "skipped_steps", "images_per_sec")  # what train() logs per log line


def cpu_ms(fn, calls: int) -> float:
    fn()
    runs = []
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append(1e3 * (time.thread_time() - c0) / calls)
    return statistics.median(runs)


def pieces(batch: int) -> dict:
    model = build_unet(P.ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    diffusion = from_params(P.DiffusionParams())
    t = torch.randint(0, diffusion.num_timesteps, (batch,))
    u = torch.rand(batch, 3, dtype=torch.float64)
    losses = {k: torch.rand(batch) for k in ("loss", "mse", "vb")}
    stats, quart = torch.zeros(4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    uniform, importance = create_sampler("uniform", 1000), create_sampler("loss-second-moment", 1000)
    first_nonfinite, total_norm = torch.zeros((), dtype=torch.long), torch.tensor(1.0)

    def statistics_update():  # train.py's per-step log sums
        ok = torch.isfinite(losses["loss"])
        finite = [torch.where(ok, losses[k], 0.0) for k in ("loss", "mse", "vb")]
        stats.add_(torch.stack([f.sum().double() for f in finite] + [ok.sum().double()]))
        q = (t * 4 // diffusion.num_timesteps).clamp(max=3)
        quart[0].index_add_(0, q, finite[0].double())
        quart[1].index_add_(0, q, ok.double())
        torch.where(torch.isfinite(total_norm) | (first_nonfinite > 0), first_nonfinite, 3)

    from dvclive import Live

    live = Live(dir=tempfile.mkdtemp(), dvcyaml=False, save_dvc_exp=False)

    def log_line():
        for k in LOG_KEYS:
            live.log_metric(k, 0.5)
        live.next_step()

    return {
        "per-example seeded draws (train.example_draws)":
            (lambda: example_draws([step_seed(0, 5, i, 1) for i in range(batch)], (1, 8, 8)), 200),
        "the same, a fresh generator per example (before issue 16)": (lambda: _fresh_generator_draws(batch), 200),
        "a dvclive log line (once per train.log_every steps)": (log_line, 20),
        "model.parameters() walk (clip_grad_norm_'s argument)": (lambda: list(model.parameters()), 200),
        "torch.manual_seed (the step's dropout masks)": (lambda: torch.manual_seed(12345), 200),
        "loss statistics and the non-finite check": (statistics_update, 200),
        "timestep draw (uniform sampler)": (lambda: uniform.sample_from_uniform(u[:, 2]), 200),
        "importance sampler: draw + update": (lambda: (importance.sample_from_uniform(u[:, 2]),
                                                       importance.update(t, losses["loss"])), 200),
    }


def _fresh_generator_draws(batch: int):
    u, noise = torch.empty(batch, 3, dtype=torch.float64), torch.empty(batch, 1, 8, 8)
    for i in range(batch):
        g = torch.Generator().manual_seed(step_seed(0, 5, i, 1))
        u[i] = torch.rand(3, generator=g, dtype=torch.float64)
        noise[i] = torch.randn((1, 8, 8), generator=g)
    return u, noise


def hooks_ms(pairs: int) -> float:
    """What the introspection hooks cost a step while not recording (they stay attached in train()):
    forward + backward at batch 1, where the hooks' Python work is not lost in the kernels, on two
    copies of the model, one with the recorder attached; calls alternate between the two and the
    result is the median of the per-pair differences."""
    torch.manual_seed(0)
    bare = build_unet(P.ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    hooked = copy.deepcopy(bare)
    x, t, y = torch.randn(1, 1, 8, 8), torch.tensor([500]), torch.tensor([3])

    def step_ms(model) -> float:
        c0 = time.thread_time()
        model(x, t, y).square().mean().backward()
        return 1e3 * (time.thread_time() - c0)

    with ActivationGradRecorder(hooked, P.IntrospectParams().modules):
        for model in (bare, hooked, bare, hooked):
            step_ms(model)
        return statistics.median(step_ms(hooked) - step_ms(bare) for _ in range(pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--calls", type=float, default=1.0, help="scale the number of calls per run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name, (fn, calls) in pieces(a.batch).items():
        print(f"{cpu_ms(fn, max(1, int(calls * a.calls))):8.3f} ms  {name}", flush=True)
    print(f"{hooks_ms(max(1, int(400 * a.calls))):8.3f} ms  introspection hooks attached, not recording "
          "(forward + backward, with - without)", flush=True)


if __name__ == "__main__":
    main()
