"""What storing the post-hoc EMA snapshots in fp16 or bf16 (`train.posthoc_ema_dtype`) does to the
reconstructed averages, and to FID, against fp32 snapshots of the same run.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/phema_precision.py --model models/ddpm --tag default
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/phema_precision.py --model models/ddpm --tag default \\
        --fid-lengths 0.05,0.08,0.15 --seeds 0,1 --evaluator models/evaluator --data data/prepared

--model is a model directory trained with `train.posthoc_ema_dtype: fp32`. Its snapshots are rounded
to each dtype as training stores them (`training.phema.PowerEMA`: every floating tensor cast, round to
nearest) into a copy of the directory, and every length is reconstructed from both
(`model_dir.reconstruct`, the fp64 sum the sample stage runs; the fp32 ones from a copy too, with the
SHA256SUMS a directory exported before it existed lacks). Per length: the relative L2 error of
the weights over every floating tensor, ||w_dtype - w_fp32|| / ||w_fp32||; the largest error of one
element over the largest weight; sum |c_i|, with the bound it gives (u sum |c_i|, u = 2^-11 for fp16,
2^-8 for bf16: the per-element rounding of each snapshot, |c_i| times); and for scale, how far the
fp32 reconstruction of the next length in --lengths is (what choosing another length moves).

With --fid-lengths: `sample.per_class` images per class at each sampling seed from each snapshot
dtype's reconstruction, generated as the sample stage does (per-image seeds: the same noise for
every dtype), scored as the evaluate stage does (FID, precision, recall in the evaluator's
features); and the share of pixels (uint8) that differ from the fp32 snapshots' images.
Writes benchmarks/results/phema_precision[-<tag>].json.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ddpmrepro import files
from ddpmrepro import params as P
from ddpmrepro.model import phema
from ddpmrepro.model_dir import (CONFIG_FILE, PHEMA_DIR, add_to_manifest, list_snapshots, load_model, read_config,
                                 reconstruct)
from ddpmrepro.training.phema import DTYPES
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "fp32": 2.0 ** -24}


def rounded_copy(model: Path, dtype: str, out: Path) -> Path:
    """`model`'s config.json and its snapshots rounded to `dtype` (with their own SHA256SUMS) in `out`."""
    (out / PHEMA_DIR).mkdir(parents=True)
    shutil.copyfile(model / CONFIG_FILE, out / CONFIG_FILE)
    digests = {}
    for s in list_snapshots(model / PHEMA_DIR):
        weights = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in files.load_weights(s.path).items()}
        assert all(torch.isfinite(v).all() for v in weights.values()), f"{s.path}: outside {dtype}'s range"
        path = out / PHEMA_DIR / s.path.name
        files.save_weights(weights, path, metadata=files.weights_metadata(s.path))
        digests[path.name] = files.sha256(path)
    add_to_manifest(out / PHEMA_DIR, digests)
    return out


def coefficients(directory: Path, length: float) -> np.ndarray:
    """c of `reconstruct`'s solve at the last step (the same selection of snapshots)."""
    snaps = list({(s.updates, s.sigma_rel): s for s in list_snapshots(directory) if s.updates > 0}.values())
    c, _ = phema.solve([(s.updates, s.sigma_rel) for s in snaps], max(s.updates for s in snaps), length)
    return c


def distance(a: dict, b: dict) -> tuple[float, float]:
    """(||a - b|| / ||b|| over every floating tensor, max |a - b| / max |b|), in fp64."""
    keys = [k for k, v in b.items() if v.is_floating_point()]
    diff2 = sum(float((a[k].double() - b[k].double()).square().sum()) for k in keys)
    norm2 = sum(float(b[k].double().square().sum()) for k in keys)
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)
    return math.sqrt(diff2 / norm2), worst / max(float(b[k].abs().max()) for k in keys)


def weights_table(dirs: dict[str, Path], lengths: list[float], train, run_hash: str) -> list[dict]:
    ref = {L: reconstruct(dirs["fp32"] / PHEMA_DIR, L, train, run_hash=run_hash) for L in lengths}
    rows = []
    for i, L in enumerate(lengths):
        c = coefficients(dirs["fp32"] / PHEMA_DIR, L)
        row = {"length": L, "sum_abs_c": float(np.abs(c).sum())}
        if i + 1 < len(lengths):
            row["next_length"] = lengths[i + 1]
            row["rel_l2_to_next_length"] = distance(ref[lengths[i + 1]], ref[L])[0]
        for dtype, d in dirs.items():
            if dtype == "fp32":
                continue
            rel, worst = distance(reconstruct(d / PHEMA_DIR, L, train, run_hash=run_hash), ref[L])
            row[dtype] = {"rel_l2": rel, "max_rel": worst, "bound_u_sum_abs_c": UNIT_ROUNDOFF[dtype] * row["sum_abs_c"]}
        rows.append(row)
        print(f"length {L:g}: sum|c| {row['sum_abs_c']:.2f}  " + "  ".join(
            f"{k} rel L2 {v['rel_l2']:.2e} max {v['max_rel']:.2e}" for k, v in row.items() if isinstance(v, dict))
            + (f"  (to {row['next_length']:g}: {row['rel_l2_to_next_length']:.2e})" if "next_length" in row else ""),
            flush=True)
    return rows


def images_of(model, trained, config, p: P.SampleParams) -> np.ndarray:
    """The sample stage's images (uint8, per-image seeds), on this CPU."""
    from ddpmrepro.evaluation.sample import generate, image_seed, process

    data = config["data"]
    num_classes, shape = data["num_classes"], (data["channels"], data["image_size"], data["image_size"])
    diffusion, _ = process(trained.diffusion, p, Path("model"))
    n = num_classes * p.per_class
    images = np.empty((n, *shape), dtype=np.uint8)
    for b in range(0, n, p.batch_size):
        ks = list(range(b, min(n, b + p.batch_size)))
        labels = torch.tensor([i // p.per_class for i in ks])
        images[b:b + len(ks)] = generate(model, diffusion, labels, [image_seed(p.seed, i) for i in ks], p,
                                         num_classes, shape, torch.device("cpu")).numpy()
    return images


def fid_table(dirs: dict[str, Path], lengths: list[float], seeds: list[int], params: P.Params, a) -> list[dict]:
    from ddpmrepro.data import load_prepared
    from ddpmrepro.evaluation.evaluator import load_evaluator
    from ddpmrepro.evaluation.metrics import feature_metrics

    evaluator = load_evaluator(a.evaluator)
    data = load_prepared(a.data)
    f_test = evaluator.features(data.test_images)
    rows = []
    for L in lengths:
        for seed in seeds:
            p = dataclasses.replace(params.sample, ema_length=L, seed=seed)
            ref = None
            for dtype, d in dirs.items():
                model, trained, config = load_model(d, p.ema_rate, ema_length=L)
                start = time.perf_counter()
                images = images_of(model, trained, config, p)
                labels = np.arange(len(images)) // p.per_class
                f_gen, logits = evaluator.features_and_logits(images)
                m = feature_metrics(f_gen, labels, f_test, data.test_labels, logits_gen=logits,
                                    k=params.evaluate.pr_neighbourhood, kid_subset_size=min(1000, len(images)))
                ref = images if ref is None else ref  # fp32 first
                row = {"length": L, "seed": seed, "dtype": dtype, "fid": m["fid"], "precision": m["precision"],
                       "recall": m["recall"], "class_acc": m["accuracy"],
                       "pixels_differing": float((images != ref).mean()),
                       "max_pixel_diff": int(np.abs(images.astype(int) - ref.astype(int)).max()),
                       "wall_s": time.perf_counter() - start}
                rows.append(row)
                print(f"length {L:g} seed {seed} {dtype}: fid {row['fid']:.4f} P {row['precision']:.3f} "
                      f"R {row['recall']:.3f} pixels differing {row['pixels_differing']:.2%} "
                      f"(max {row['max_pixel_diff']})", flush=True)
    return rows


def markdown(results: list[dict]) -> str:
    """docs/POSTHOC_EMA.md's tables: the weights per run and length, then FID per length and seed."""
    lines = ["| run | length | sum \\|c\\| | fp16: rel. L2 (bound u sum \\|c\\|) | bf16: rel. L2 | fp32: to the next length |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for row in r["weights"]:
            nxt = (f"{row['rel_l2_to_next_length']:.1e} (to {row['next_length']:g})" if "next_length" in row else "")
            lines.append(f"| {r['steps']:,} steps | {row['length']:g} | {row['sum_abs_c']:.2f} | "
                         f"{row['fp16']['rel_l2']:.1e} ({row['fp16']['bound_u_sum_abs_c']:.1e}) | "
                         f"{row['bf16']['rel_l2']:.1e} | {nxt} |")
    fid = [(r, row) for r in results for row in r.get("fid", [])]
    if fid:
        lines += ["", "| run | length | seed | FID fp32 | FID fp16 | FID bf16 | pixels changed fp16 / bf16 (max levels) |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        keys = list(dict.fromkeys((id(r), row["length"], row["seed"]) for r, row in fid))
        for rid, L, seed in keys:
            by = {row["dtype"]: (r, row) for r, row in fid if id(r) == rid and row["length"] == L and row["seed"] == seed}
            r = by["fp32"][0]
            lines.append(f"| {r['steps']:,} steps | {L:g} | {seed} | {by['fp32'][1]['fid']:.4f} | "
                         f"{by['fp16'][1]['fid']:.4f} | {by['bf16'][1]['fid']:.4f} | "
                         f"{by['fp16'][1]['pixels_differing']:.1%} ({by['fp16'][1]['max_pixel_diff']}) / "
                         f"{by['bf16'][1]['pixels_differing']:.1%} ({by['bf16'][1]['max_pixel_diff']}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/ddpm"), help="trained with posthoc_ema_dtype: fp32")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="sample.* and evaluate.* for --fid-lengths")
    ap.add_argument("--lengths", default="0.035,0.05,0.065,0.08,0.1,0.15,0.2")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--fid-lengths", default="", help="lengths to sample and score ('' = none)")
    ap.add_argument("--seeds", default="0", help="sample.seed values for --fid-lengths")
    ap.add_argument("--evaluator", type=Path, default=Path("models/evaluator"))
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", default="", help="print docs/POSTHOC_EMA.md's tables of these results JSONs "
                                               "(comma-separated), run nothing")
    a = ap.parse_args()
    if a.table:
        import json

        print(markdown([json.loads(Path(f).read_text()) for f in a.table.split(",")]))
        return
    torch.set_num_threads(a.threads)
    config = read_config(a.model)
    trained = P.from_dict(config["params"])
    stored = config["params"]["train"].get("posthoc_ema_dtype", "fp32")  # fp32: written before the key
    if stored != "fp32":
        raise SystemExit(f"{a.model}: its snapshots are {stored}; this needs fp32 ones")
    lengths = [float(x) for x in a.lengths.split(",")]
    dtypes = [d for d in a.dtypes.split(",") if d]
    out = a.out or Path(__file__).parent / "results" / f"phema_precision{'-' + a.tag if a.tag else ''}.json"
    snaps = list_snapshots(a.model / PHEMA_DIR)
    result = {"command": command_line("phema_precision.py", a, skip=("out", "table")), "threads": a.threads, "torch": torch.__version__,
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpus_allowed": len(os.sched_getaffinity(0))},
              "model": str(a.model), "run_hash": config["run_hash"], "preset": trained.model.preset,
              "steps": trained.train.steps, "tracked": list(trained.train.posthoc_ema),
              "snapshots_per_length": trained.train.posthoc_ema_snapshots,
              "snapshot_bytes": {"fp32": sum(s.path.stat().st_size for s in snaps)}, "unit_roundoff": UNIT_ROUNDOFF}
    with tempfile.TemporaryDirectory(prefix="phema-precision-") as tmp:
        dirs = {}
        for dtype in ["fp32", *dtypes]:  # fp32 too: a model directory from before SHA256SUMS gets one
            dirs[dtype] = rounded_copy(a.model, dtype, Path(tmp) / dtype)
            result["snapshot_bytes"][dtype] = sum(p.stat().st_size for p in (dirs[dtype] / PHEMA_DIR).glob("step_*"))
        result["weights"] = weights_table(dirs, lengths, trained.train, config["run_hash"])
        write_result(result, out)
        if a.fid_lengths:
            params = P.load(a.params)
            result["fid"] = fid_table(dirs, [float(x) for x in a.fid_lengths.split(",")],
                                      [int(s) for s in a.seeds.split(",")], params, a)
            write_result(result, out)


if __name__ == "__main__":
    main()
