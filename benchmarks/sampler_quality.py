"""Sample quality against network calls (NFE) for every sampler, on the default pipeline's trained model.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampler_quality.py --threads 1
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampler_quality.py --threads 1 --seeds 0 --nfes 10,20

For each seed set, sampler and NFE budget: `per_class` images per class through
`ddpmrepro.evaluation.sample.generate` (what `ddpmrepro sample` runs: per-image seeded noise, the
params' guidance as one doubled batch, uint8 output), then the evaluate stage's evaluator-space
metrics against the real test split (FID, precision, recall, class accuracy). The wall time of
the sampling alone is recorded per run (CPU, --threads threads). DDIM at N calls is `respacing:
ddimN` (today's sampler, bit for bit); the fast solvers use `sample.nfe: N` with their spacing;
heun makes 2M-1 calls, so its even budgets run one call less (the JSON records the actual NFE).
With `--reference 1000`, each run also gets its images' RMS distance from the same seeds' DDIM-1000
images (the ODE's converged solution, which DDIM, DPM-Solver++ and UniPC all approximate):

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampler_quality.py --samplers ddim,dpmpp_2m,unipc --nfes 10,20,50 --reference 1000 --per-class 10 --tag reference
Seed set s gives image k the seed (s, k) as the sample stage does (`sample.seed: s`).
Writes benchmarks/results/sampler_quality[-<tag>].json, rewritten after every run (a long run can be
stopped and its finished runs kept).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ddpmrepro import params as P
from ddpmrepro.data import load_prepared
from ddpmrepro.evaluation.evaluator import load_evaluator
from ddpmrepro.evaluation.metrics import feature_metrics
from ddpmrepro.evaluation.sample import generate, image_seed, process
from ddpmrepro.model_dir import load_model
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path

SPACING = {"dpmpp_2m": "logsnr", "dpmpp_2m_sde": "logsnr", "unipc": "logsnr", "heun": "karras"}


def sample_images(model, trained, config, p: P.SampleParams) -> tuple[np.ndarray, int, float]:
    """`per_class` images per class as the sample stage makes them: (uint8 images, NFE, wall s)."""
    data = config["data"]
    num_classes, shape = data["num_classes"], (data["channels"], data["image_size"], data["image_size"])
    diffusion, nfe = process(trained.diffusion, p, Path("model"))
    n = num_classes * p.per_class
    images = np.empty((n, *shape), dtype=np.uint8)
    start = time.perf_counter()
    for b in range(0, n, p.batch_size):
        ks = list(range(b, min(n, b + p.batch_size)))
        labels = torch.tensor([i // p.per_class for i in ks])
        images[b:b + len(ks)] = generate(model, diffusion, labels, [image_seed(p.seed, i) for i in ks], p,
                                         num_classes, shape, torch.device("cpu")).numpy()
    return images, nfe, time.perf_counter() - start


def run_one(model, trained, config, p: P.SampleParams, f_test, y_test, evaluator, k: int,
            reference: np.ndarray | None = None) -> dict:
    images, nfe, wall = sample_images(model, trained, config, p)
    n = len(images)
    labels = np.arange(n) // p.per_class
    f_gen, logits = evaluator.features_and_logits(images)
    m = feature_metrics(f_gen, labels, f_test, y_test, logits_gen=logits, k=k, kid_subset_size=min(1000, n))
    out = {"nfe": nfe, "wall_s": wall, "fid": m["fid"], "precision": m["precision"], "recall": m["recall"],
           "class_acc": m["accuracy"]}
    if reference is not None:
        out["rms_to_reference"] = rms_levels(images, reference)
    return out


def rms_levels(images: np.ndarray, reference: np.ndarray) -> float:
    """Mean over images of each image's RMS difference from the same seed's reference image, in
    uint8 levels: how far a solver's images are from the converged ODE solution's (DDIM with many
    steps), image by image, where FID compares distributions."""
    d = images.astype(np.float64) - reference.astype(np.float64)
    return float(np.sqrt((d ** 2).reshape(len(d), -1).mean(1)).mean())


def summarise(runs: list[dict]) -> list[dict]:
    """Mean and sample std over seeds per (sampler, budget)."""
    keys = list(dict.fromkeys((r["sampler"], r["budget"]) for r in runs))  # in the order run
    rows = []
    for sampler, budget in keys:
        rs = [r for r in runs if r["sampler"] == sampler and r["budget"] == budget]
        row = {"sampler": sampler, "budget": budget, "nfe": rs[0]["nfe"], "seeds": len(rs)}
        for m in ("fid", "precision", "recall", "class_acc", "wall_s", "rms_to_reference"):
            if m not in rs[0]:
                continue
            vals = [r[m] for r in rs]
            row[m] = statistics.fmean(vals)
            row[m + "_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """The docs/BENCHMARKS.md table: mean +- std over seed sets per sampler and budget."""
    def pm(row, key, fmt):
        std = row[key + "_std"]
        return format(row[key], fmt) + ("" if std is None else " ± " + format(std, fmt))

    ref = result.get("reference_steps")
    lines = ["| sampler | NFE | FID | precision | recall | class acc | sampling wall s |"
             + (f" RMS to DDIM-{ref}, levels |" if ref else ""), "|---|---|---|---|---|---|---|" + ("---|" if ref else "")]
    for row in result["summary"]:
        lines.append(f"| {row['sampler']} | {row['nfe']} | {pm(row, 'fid', '.3f')} | {pm(row, 'precision', '.3f')} | "
                     f"{pm(row, 'recall', '.3f')} | {pm(row, 'class_acc', '.3f')} | {pm(row, 'wall_s', '.1f')} |"
                     + (f" {pm(row, 'rms_to_reference', '.2f')} |" if ref else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="sample.* defaults (guidance, ema)")
    ap.add_argument("--model", type=Path, default=Path("models/ddpm"))
    ap.add_argument("--evaluator", type=Path, default=Path("models/evaluator"))
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--samplers", default="ddim,dpmpp_2m,dpmpp_2m_sde,unipc,heun")
    ap.add_argument("--nfes", default="5,10,15,20,50", help="network-call budgets")
    ap.add_argument("--seeds", default="0,1,2", help="sample.seed values (seed sets)")
    ap.add_argument("--per-class", type=int, default=0, help="images per class (0: params' sample.per_class)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reference", type=int, default=0,
                    help="also each image's RMS distance (uint8 levels) from the same seed's DDIM image with this "
                         "many steps (e.g. 1000: the converged ODE solution); 0: off")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="print the markdown table of this results JSON, run nothing")
    a = ap.parse_args()
    if a.table:
        import json

        print(markdown(json.loads(a.table.read_text())))
        return
    torch.set_num_threads(a.threads)
    params = P.load(a.params)
    base = params.sample
    if a.per_class:
        base = dataclasses.replace(base, per_class=a.per_class)
    model, trained, config = load_model(a.model, base.ema_rate)
    evaluator = load_evaluator(a.evaluator)
    data = load_prepared(a.data)
    f_test = evaluator.features(data.test_images)
    out = a.out or Path(__file__).parent / "results" / f"sampler_quality{'-' + a.tag if a.tag else ''}.json"
    result = {"command": command_line("sampler_quality.py", a, skip=("out", "table")), "threads": a.threads,
              "model": str(a.model), "T": trained.diffusion.timesteps, "schedule": trained.diffusion.schedule,
              "guidance": base.guidance, "per_class": base.per_class, "images": config["data"]["num_classes"]
              * base.per_class, "reference_steps": a.reference or None, "runs": [], "summary": []}
    for seed in [int(s) for s in a.seeds.split(",")]:
        reference = None
        if a.reference:
            reference, _, wall = sample_images(model, trained, config, dataclasses.replace(
                base, sampler="ddim", respacing=f"ddim{a.reference}", seed=seed))
            print(f"seed {seed} reference DDIM-{a.reference}: {wall:.1f}s", flush=True)
        for sampler in a.samplers.split(","):
            for budget in [int(n) for n in a.nfes.split(",")]:
                if sampler in ("ddim", "ddpm"):
                    p = dataclasses.replace(base, sampler=sampler, respacing=f"ddim{budget}", seed=seed)
                else:
                    p = dataclasses.replace(base, sampler=sampler, nfe=budget, spacing=SPACING[sampler], seed=seed)
                r = run_one(model, trained, config, p, f_test, data.test_labels, evaluator,
                            params.evaluate.pr_neighbourhood, reference)
                result["runs"].append({"sampler": sampler, "budget": budget, "seed": seed, **r})
                print(f"seed {seed} {sampler:13s} budget {budget:3d} nfe {r['nfe']:3d}  fid {r['fid']:.4f}  "
                      f"P {r['precision']:.3f} R {r['recall']:.3f} acc {r['class_acc']:.3f}  {r['wall_s']:.1f}s"
                      + (f"  rms {r['rms_to_reference']:.2f}" if reference is not None else ""),
                      flush=True)
                result["summary"] = summarise(result["runs"])
                write_result(result, out)


if __name__ == "__main__":
    main()
