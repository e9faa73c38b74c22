"""Markdown tables for docs/BENCHMARKS.md from the results JSONs, so the doc quotes them exactly.

    PYTHONPATH=src python benchmarks/tables.py benchmarks/results/train_step-threads1.json \
        benchmarks/results/train_step-threads2.json
    PYTHONPATH=src python benchmarks/tables.py benchmarks/results/sample_speed-threads*.json
    PYTHONPATH=src python benchmarks/tables.py benchmarks/results/growth-threads*.json

Files of one kind (train_step, sample_speed or growth) per call; one table, a row per contender
(or sampler, or growth row) and file. A ratio reads: median [95% interval of the median]
(interquartile range), then the verdict against the target.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def ratio_cell(s: dict) -> str:
    ci = f" [{s['median_ci95'][0]:.3f}-{s['median_ci95'][1]:.3f}]" if s["median_ci95"] else ""
    return f"{s['median']:.3f}{ci} ({s['q1']:.3f}-{s['q3']:.3f})"


def load_cell(t: dict) -> str:
    return (f"{t['before']['load_avg'][0]:.1f} → {t['after']['load_avg'][0]:.1f} "
            f"(max {max(t['load1_per_round']):.1f})")


def verdict_cell(v: str) -> str:
    return {"met": "**met**", "missed": "**missed**"}.get(v, "not resolved")


def train_step(results: list[dict]) -> list[str]:
    rows = ["| threads | load (1-min avg: before → after, max over rounds) | contender | images/s | step time / plain, wall | CPU | target ≤ 1.05 |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["timing"]
        for m, ips in r["images_per_sec"].items():
            verdict = verdict_cell(r["target"]["verdict"][m]) if m in r["target"]["verdict"] else ""
            wall = ratio_cell(t["ratio_wall"][m]) if m != "plain" else "1"
            cpu = ratio_cell(t["ratio_cpu"][m]) if m != "plain" else "1"
            rows.append(f"| {r['threads']} | {load_cell(t)} | `{m}` | {ips:.0f} | {wall} | {cpu} | {verdict} |")
    return rows


def sample_speed(results: list[dict]) -> list[str]:
    rows = ["| threads | load (1-min avg: before → after, max over rounds) | sampler | images per block | ddpmrepro img/s | bare UNet img/s "
            "| time / bare, wall | CPU | target ≤ 1.05 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["samplers"].items():
            t = s["timing"]
            ips = s["images_per_sec"]
            rows.append(f"| {r['threads']} | {load_cell(t)} | {name} | {s['images']} | {ips['ddpmrepro']:.1f} | "
                        f"{ips['bare']:.1f} | {ratio_cell(s['time_ratio_vs_bare'])} | "
                        f"{ratio_cell(t['ratio_cpu']['ddpmrepro'])} | {verdict_cell(s['verdict'])} |")
    return rows


def growth(results: list[dict]) -> list[str]:
    rows = ["| threads | load (1-min avg: before → after, max over rounds) | preset | image | parameters | GFLOP / image (train) | images/s "
            "| s / step | achieved GFLOP/s | FLOPs / first row | step time / first row |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            rows.append(f"| {r['threads']} | {load_cell(r['timing'])} | {row['preset']} | {row['image_size']} px | "
                        f"{row['params'] / 1e6:.2f}M | {row['train_gflops_per_image']:.3g} | "
                        f"{row['images_per_sec']:.3g} | {row['step_seconds']:.3g} | "
                        f"{1e3 * row['achieved_tflops']:.3g} | {row['flop_ratio_vs_first']:.3g} | "
                        f"{ratio_cell(row['step_time_ratio_vs_first'])} |")
    return rows


KINDS = {"train_step": train_step, "sample_speed": sample_speed, "growth": growth}


def kind_of(result: dict) -> str:
    return "train_step" if "step_time_ratio_vs_plain" in result else "sample_speed" if "samplers" in result else "growth"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, nargs="+")
    a = ap.parse_args()
    results = [json.loads(f.read_text()) for f in a.files]
    kinds = {kind_of(r) for r in results}
    if len(kinds) != 1:
        ap.error(f"give files of one kind, got {sorted(kinds)}")
    print("\n".join(KINDS[kinds.pop()](results)))
    for f, r in zip(a.files, results):
        print(f"\n`{r['command']}` ({f.name})")


if __name__ == "__main__":
    main()
