"""The pictures of README.md and docs/, drawn from a finished pipeline run, so they show what the code makes.

    PYTHONPATH=src python scripts/docs_images.py [--run DIR] [--out docs/img]     # or: make docs-images

DIR is the working directory of a finished `make repro` / `dvc repro` on the default params.yaml
(default: this checkout); it is only read. Writes, each a small PNG (tens of KB):

    stage_graph.png       the stages and their dependencies, from `dvc dag --dot` of this checkout,
                          drawn by Graphviz (`apt-get install graphviz`)
    samples_grid.png      DIR/samples/grid.png (one row per class), scaled up by whole pixels
    grad_heatmap.png      DIR/reports/figures/param_grad_heatmap.png, as drawn by the report stage
    metrics_html.png      DIR/reports/metrics.html in headless Chromium (`apt-get install chromium`)
    snakemake_report.png  `snakemake --report` of DIR's outputs in headless Chromium, showing the sample
                          grid (built in a temporary copy: DIR is not touched)

Rerun it after a change that alters what a stage draws, and commit docs/img/ with that change.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from headless_chromium import Chromium  # noqa: E402  (scripts/ is no package)

# What `snakemake --report` needs of the project (the code of this checkout) and of the run (its outputs).
PROJECT_FILES = ["src", "dvc.yaml", "Snakefile", "workflow", "profiles", ".dvcignore", ".gitignore", "pyproject.toml",
                 "models/published"]  # a dep of the train stage (train.import_from), tracked in git
RUN_FILES = ["params.yaml", "metrics.json", "samples", "reports"]


def tool(*cmd: str, cwd: Path = ROOT) -> str:
    env = {**os.environ, "PYTHONPATH": str(cwd / "src"), "DVC_NO_ANALYTICS": "1",
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def save_small(image: Image.Image, path: Path, colours: int = 64) -> Path:
    """A palette PNG: figures and screenshots have few colours, and 8 bits per pixel keep them small."""
    image.convert("RGB").quantize(colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, optimize=True)
    return path


def stage_graph(out: Path) -> Path:
    """`dvc dag --dot`, each stage labelled with what it writes; check_params' edges (to every stage) dashed."""
    if shutil.which("dot") is None:
        sys.exit("Graphviz's `dot` is not installed: apt-get install graphviz")
    edges = re.findall(r'"([^"]+)" -> "([^"]+)"', tool("dvc", "dag", "--dot"))
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def label(name: str) -> str:
        stage = stages[name]
        paths = [next(iter(p)) if isinstance(p, dict) else p for key in ("metrics", "outs") for p in stage.get(key, [])]
        folders = {str(Path(p).parent) for p in paths}
        if len(paths) > 2 and len(folders) == 1:  # check_params: one file per params section
            paths = [f"{folders.pop()}/"]
        shown = ", ".join(paths[:2]) + (", ..." if len(paths) > 2 else "")
        return f'<<b>{name}</b><br/><font point-size="9">{shown}</font>>'

    lines = ["digraph stages {", "rankdir=LR; bgcolor=white; nodesep=0.15; ranksep=0.35;",
             'node [shape=box, style="rounded,filled", fillcolor="#eef3fb", color="#4a6fa5", fontname="DejaVu Sans", '
             "fontsize=11, margin=\"0.08,0.04\"];", 'edge [color="#4a6fa5", arrowsize=0.6];']
    lines += [f'"{name}" [label={label(name)}];' for name in stages]
    for a, b in edges:
        style = ' [style=dashed, color="#b0b8c4"]' if a == "check_params" else ""
        lines.append(f'"{a}" -> "{b}"{style};')
    lines.append("}")
    png = subprocess.run(["dot", "-Tpng", "-Gdpi=96"], input="\n".join(lines).encode(), capture_output=True,
                         check=True).stdout
    tmp = out.with_suffix(".tmp.png")
    tmp.write_bytes(png)
    save_small(Image.open(tmp), out, colours=32)
    tmp.unlink()
    return out


def samples_grid(run: Path, out: Path) -> Path:
    grid = Image.open(run / "samples/grid.png")
    scale = max(1, 360 // grid.width)  # whole pixels: each sample stays sharp
    grid.resize((grid.width * scale, grid.height * scale), Image.Resampling.NEAREST).save(out, optimize=True)
    return out


def grad_heatmap(run: Path, out: Path) -> Path:
    return save_small(Image.open(run / "reports/figures/param_grad_heatmap.png"), out)


def snakemake_report(run: Path, report: Path) -> Path:
    """`snakemake --report` over the run's outputs, in a temporary git + DVC repo (the Snakefile asks DVC)."""
    work = report.parent / "project"
    for name in PROJECT_FILES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, work / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir()
                                          else {}))
    for name in RUN_FILES:
        (shutil.copytree if (run / name).is_dir() else shutil.copy2)(run / name, work / name)
    tool("git", "init", "-q", cwd=work)
    tool("dvc", "init", "-q", cwd=work)
    tool("snakemake", "--report", str(report), cwd=work)
    return report


def screenshots(run: Path, out_dir: Path, tmp: Path) -> list[Path]:
    with Chromium(width=1000, height=600) as browser:
        page = browser.open(run / "reports/metrics.html")
        page.screenshot(tmp / "metrics.png")
        report = browser.open(snakemake_report(run, tmp / "report.html"))
        report.click("a", "Samples")
        report.wait_for("document.querySelectorAll('tr').length > 1")
        report.evaluate("Array.from(document.querySelectorAll('tr')).find(r => r.textContent.includes("
                        "'samples/grid.png')).querySelector('a').click()")
        report.wait_for("Array.from(document.images).some(i => i.complete && i.src.includes('filename=grid.png'))")
        report.screenshot(tmp / "report.png")
        for page_ in (page, report):
            if page_.problems:
                sys.exit(f"{page_.url}: " + "; ".join(page_.problems))
    return [save_small(Image.open(tmp / "metrics.png"), out_dir / "metrics_html.png"),
            save_small(Image.open(tmp / "report.png"), out_dir / "snakemake_report.png")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=ROOT, help="a finished pipeline run's directory (read only)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img", help="where the PNGs go")
    args = parser.parse_args()
    run = args.run.resolve()
    missing = [p for p in ("samples/grid.png", "reports/figures/param_grad_heatmap.png", "reports/metrics.html")
               if not (run / p).is_file()]
    if missing:
        sys.exit(f"{run} holds no finished run ({', '.join(missing)} missing): run `make repro` there first")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddpmrepro-docs-images-") as tmp:
        written = [stage_graph(args.out / "stage_graph.png"),
                   samples_grid(run, args.out / "samples_grid.png"),
                   grad_heatmap(run, args.out / "grad_heatmap.png"),
                   *screenshots(run, args.out, Path(tmp))]
    print(json.dumps({str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p): f"{p.stat().st_size // 1024} KB"
                      for p in written}, indent=1))


if __name__ == "__main__":
    main()
