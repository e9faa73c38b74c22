"""Where a compiled UNet's training time goes on CPU, against eager (issue 34): torch.profiler over
forward + backward of the same weights and batch, the work split into convolutions and matrix
products (the same ATen/oneDNN calls either way), the code Inductor generated (the rest, fused),
and the eager ops left over.

    PYTHONPATH=src python benchmarks/compile_profile.py                        # the 8.95M-parameter model, 32x32
    PYTHONPATH=src python benchmarks/compile_profile.py --preset tiny --image-size 8 --channels 1 --batch 128

Also times fwd+bwd and the AdamW step of each, alternating, medians of --repeats. Compiles first
(minutes on CPU; Inductor's cache makes a second run fast).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ddpmrepro import params as P
from ddpmrepro.model.unet import PRESETS, build_unet
from ddpmrepro.runtime.compilation import compile_blocks

HEAVY = ("aten::convolution_backward", "aten::mkldnn_convolution", "aten::convolution", "aten::bmm", "aten::mm",
         "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ddpm-cifar10", choices=list(PRESETS))
    ap.add_argument("--model-channels", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    mp = P.ModelParams(preset=a.preset, **({"channels": a.model_channels} if a.model_channels else {}))
    eager = build_unet(mp, image_size=a.image_size, in_channels=a.channels, num_classes=10, learn_sigma=False)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    models = {"eager": eager, "compiled": compiled}
    x = torch.randn(a.batch, a.channels, a.image_size, a.image_size)
    t, y = torch.randint(0, 1000, (a.batch,)), torch.randint(0, 10, (a.batch,))
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for n, m in models.items()}

    def fwd_bwd(m):
        m(x, t, y).square().mean().backward()

    def adamw(n):
        opts[n].step()
        opts[n].zero_grad(set_to_none=False)

    for n, m in models.items():  # compile, and warm both up
        for _ in range(2):
            fwd_bwd(m)
            adamw(n)
    times: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        for n, m in models.items():
            t0 = time.perf_counter()
            fwd_bwd(m)
            t1 = time.perf_counter()
            adamw(n)
            times.setdefault(f"{n} fwd+bwd", []).append(t1 - t0)
            times.setdefault(f"{n} adamw", []).append(time.perf_counter() - t1)
    print(f"{sum(q.numel() for q in eager.parameters()):,} parameters, batch {a.batch}, {a.threads} thread(s); "
          "median ms: " + ", ".join(f"{k} {1000 * statistics.median(v):.0f}" for k, v in times.items()))
    for n, m in models.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                fwd_bwd(m)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 2e3  # ms per fwd+bwd
        heavy = sum(e.self_cpu_time_total for e in events if e.key in HEAVY) / 2e3
        generated = sum(e.self_cpu_time_total for e in events if "CompiledFxGraph" in e.key) / 2e3
        print(f"{n:8}: {total:6.0f} ms per fwd+bwd (profiled): convolutions and matmuls {heavy:6.0f} ms "
              f"({100 * heavy / total:.0f}%), Inductor's generated code {generated:6.0f} ms, other eager ops "
              f"{total - heavy - generated:6.0f} ms")


if __name__ == "__main__":
    main()
