"""The bits_per_dim stage: test-set bits/dim of the weights `sample` draws from (IDDPM's full
variational bound: T network passes per image), written to reports/bpd.json, which `evaluate`
copies into metrics.json.

A stage of its own because it reads the model and the weights chosen (`sample.ema_rate`,
`ema_length`, `ema_step`), never the samples: a sampler, guidance or seed experiment
(`dvc exp run -S sample.guidance=1`) samples and scores again without paying for T x
`evaluate.bpd_images` passes it would only repeat: on the default run evaluate took 29 s with
bits/dim and 11 s without (one thread, 2026-11-29, beside other jobs). The file says which weights
and images it scored; `evaluate` refuses one made for others.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..data import load_prepared, to_model_range
from ..files import CheckpointError, atomic_write_text, read_json
from ..model.diffusion import from_params as diffusion_from_params
from ..model_dir import load_model
from ..params import Params


@torch.no_grad()
def test_bits_per_dim(params: Params, model_dir: Path, images: np.ndarray, labels: np.ndarray) -> float:
    """Mean bits/dim of the test images under the trained model (full VLB + prior)."""
    model, trained, _ = load_model(model_dir, params.sample.ema_rate, ema_length=params.sample.ema_length,
                                   ema_step=params.sample.ema_step)
    diffusion = diffusion_from_params(trained.diffusion)
    x0 = to_model_range(images)
    y = torch.as_tensor(labels, dtype=torch.long)
    # Score several timesteps per model call (~256 rows): one call per timestep at a small
    # batch is dominated by per-call overhead on CPU.
    total, batch = [], 64
    for start in range(0, len(x0), batch):
        xb, yb = x0[start:start + batch], y[start:start + batch]
        k = max(1, 256 // len(xb))
        gens = [torch.Generator().manual_seed(start + i) for i in range(len(xb))]
        yk = yb.repeat(k) if model.label_embed is not None else None  # None: an unconditional model
        out = diffusion.bits_per_dim(lambda x, t, yk=yk: model(x, t, yk), xb, generators=gens,
                                     timesteps_per_call=k)
        total.append(out["total_bpd"])
    return float(torch.cat(total).mean())


def scored(params: Params, num_test: int) -> dict:
    """What a bits/dim result is of: the first `images` test images, under the weights `sample`
    picks. Written into reports/bpd.json and compared by `evaluate`."""
    s = params.sample
    return {"images": min(params.evaluate.bpd_images, num_test),
            "weights": {"ema_rate": s.ema_rate, "ema_length": s.ema_length, "ema_step": s.ema_step}}


def bits_per_dim(params: Params, data_dir: Path, model_dir: Path) -> dict:
    """{"bpd": mean bits/dim or None (evaluate.bpd_images: 0), **scored(...)}."""
    data = load_prepared(data_dir)
    what = scored(params, len(data.test_images))
    k = what["images"]
    bpd = test_bits_per_dim(params, model_dir, data.test_images[:k], data.test_labels[:k]) if k else None
    return {"bpd": bpd, **what}


def write(result: dict, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    return out


FIX = "rerun `dvc repro bits_per_dim` (or `ddpmrepro bits-per-dim`)"


def read(path: Path, params: Params, num_test: int) -> dict | None:
    """The {"bpd", "images"} of a bits_per_dim result at `path` made for these params (None where
    `evaluate.bpd_images` is 0); CheckpointError, one line naming the file, for a damaged one or one
    of other weights or images (a stale file passed by hand)."""
    result = read_json(path, FIX)
    bpd = result.get("bpd")
    if bpd is not None and (isinstance(bpd, bool) or not isinstance(bpd, (int, float)) or not np.isfinite(bpd)):
        raise CheckpointError(f"{path}: bpd is {bpd!r}, not a finite number; {FIX}")
    want = scored(params, num_test)
    got = {k: result.get(k) for k in want}
    if got != want:
        raise CheckpointError(f"{path}: made for {json.dumps(got, sort_keys=True)}, these params score "
                              f"{json.dumps(want, sort_keys=True)}; {FIX}")
    if (bpd is None) != (want["images"] == 0):
        raise CheckpointError(f"{path}: bpd is {bpd!r} for {want['images']} images; {FIX}")
    return {"bpd": float(bpd), "images": want["images"]} if want["images"] else None
