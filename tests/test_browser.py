"""The pipeline's HTML outputs in a real browser (headless Chromium, Debian's `chromium` package).

`reports/metrics.html` and a `snakemake --report` file of the tiny end-to-end run (tests/conftest.py's
`tiny_pipeline`, shared with tests/test_pipeline.py) are opened as a reader would open them: they
must render, every image must load and decode at the size of the file it shows, and the page must
log no error, throw no exception and fail no request. A broken page proves the checks can fail.
scripts/docs_images.py, which draws the README's pictures from a run, is run on the same outputs.
Skipped where no Chromium is installed (`.ci/run` installs it when it runs as root).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image

from project_copy import run

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("headless_chromium", ROOT / "scripts" / "headless_chromium.py")
headless_chromium = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headless_chromium)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(headless_chromium.find_chromium() is None,
                       reason="no Chromium installed (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def browser():
    with headless_chromium.Chromium() as browser:
        yield browser


def grey_levels(png: Path) -> int:
    return len(Image.open(png).convert("L").getcolors(256))


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    page_file = tmp_path / "broken.html"
    page_file.write_text('<html><body><img src="missing.png"><img src="data:image/png;base64,AAAA">'
                         '<script>console.error("boom"); no_such_function();</script></body></html>')
    page = browser.open(page_file)
    problems = "\n".join(page.problems)
    assert "console.error: boom" in problems and "no_such_function is not defined" in problems, problems
    assert "ERR_FILE_NOT_FOUND" in problems, problems
    assert [image["width"] for image in page.images()] == [0, 0]  # neither image decoded


def test_metrics_page_renders_every_value(tiny_pipeline, browser, tmp_path):
    repo = tiny_pipeline.repo
    page = browser.open(repo / "reports/metrics.html")
    assert page.problems == []
    assert all(image["complete"] and image["width"] > 0 for image in page.images())  # none today; any added must load
    # What it shows, against the files the evaluate stage wrote beside it.
    tables = page.evaluate("Array.from(document.querySelectorAll('table')).map(t => Array.from(t.rows).map("
                           "r => Array.from(r.cells).map(c => c.innerText.trim())))")
    metrics = json.loads((repo / "metrics.json").read_text())
    detail = json.loads((repo / "reports/metrics_detail.json").read_text())
    headline, per_class = tables[0], tables[1]
    assert [row[0] for row in headline[1:]] == list(metrics)
    for row in headline[1:]:
        assert float(row[1]) == pytest.approx(metrics[row[0]], rel=1e-3), row
    assert [row[0] for row in per_class[1:]] == sorted(detail["per_class"], key=int)
    assert [int(row[1]) for row in per_class[1:]] == [c["n"] for _, c in sorted(detail["per_class"].items(),
                                                                                    key=lambda kv: int(kv[0]))]
    # It fits the window (no sideways scrolling) and draws something.
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert grey_levels(page.screenshot(tmp_path / "metrics.png")) > 2


def test_snakemake_report_shows_every_result(tiny_pipeline, browser, tmp_path):
    repo = tiny_pipeline.repo
    report = tmp_path / "report.html"
    run(repo, "snakemake", "--report", str(report))
    page = browser.open(report)
    assert page.problems == []
    categories = ["Metrics", "Samples", "Training and gradients"]
    assert all(name in page.text() for name in categories)
    shown = {}
    rows = "Array.from(document.querySelectorAll('tr')).slice(1).map(r => r.textContent.trim())"
    for category in categories:
        page.click("a", category)
        files = page.wait_for(f"(r => r.length && r)({rows})")
        for name in files:
            # The eye icon: the first link of the file's row shows the file in the main pane.
            page.evaluate(f"Array.from(document.querySelectorAll('tr')).find(r => r.textContent.trim() === "
                          f"{json.dumps(name)}).querySelector('a').click()")
            if name.endswith(".png"):
                shown[name] = tuple(page.wait_for(
                    f"(i => i && [i.naturalWidth, i.naturalHeight])(Array.from(document.images).find(i => "
                    f"i.complete && i.src.includes({json.dumps('filename=' + Path(name).name + ';')})))"))
            elif name.endswith(".html"):  # reports/metrics.html, in an iframe
                shown[name] = tuple(page.wait_for("(f => f && [f.offsetWidth, f.offsetHeight])("
                                                  "document.querySelector('iframe'))"))
                assert min(shown[name]) > 100, name
        page.click("a", "Results")  # back to the overview
        page.wait_for(f"{rows}.length == 0")
    pngs = ["samples/grid.png", *(f"reports/figures/{p.name}" for p in (repo / "reports/figures").glob("*.png"))]
    assert len(pngs) >= 7 and set(pngs) <= set(shown) and "reports/metrics.html" in shown
    for name in pngs:  # each decoded at the size of the file the pipeline wrote
        assert shown[name] == Image.open(repo / name).size, name
    assert page.problems == []


@pytest.mark.skipif(shutil.which("dot") is None, reason="no Graphviz for the stage graph (apt-get install graphviz)")
def test_docs_images_are_drawn_from_the_run(tiny_pipeline, tmp_path):
    repo = tiny_pipeline.repo
    run(ROOT, sys.executable, str(ROOT / "scripts/docs_images.py"), "--run", str(repo), "--out", str(tmp_path))
    made = {p.name: p for p in tmp_path.glob("*.png")}
    assert set(made) == {"stage_graph.png", "samples_grid.png", "grad_heatmap.png", "metrics_html.png",
                         "snakemake_report.png"}
    assert all(p.stat().st_size < 100_000 for p in made.values())  # small enough to commit
    # The samples are the run's grid, enlarged by whole pixels and nothing else.
    grid, shown = Image.open(repo / "samples/grid.png"), Image.open(made["samples_grid.png"])
    scale = shown.width // grid.width
    assert scale >= 1 and shown.size == (grid.width * scale, grid.height * scale)
    assert shown.resize(grid.size, Image.Resampling.NEAREST).tobytes() == grid.tobytes()
    assert Image.open(made["grad_heatmap.png"]).size == Image.open(repo / "reports/figures/param_grad_heatmap.png").size
    assert Image.open(made["metrics_html.png"]).size == (1000, 600)
    assert grey_levels(made["stage_graph.png"]) > 2 and grey_levels(made["snakemake_report.png"]) > 2
