"""The README and docs/ hold together: every link and picture points at a file that exists, every docs
page is reachable from the README, the pictures stay small enough to commit (scripts/docs_images.py),
and numbers the docs give about the code are the code's."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target) in Markdown; src="target" in the HTML the README uses for pictures side by side
LINK = re.compile(r"\]\(([^)\s]+)\)|<img[^>]*\ssrc=\"([^\"]+)\"")


def local_targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    targets = [a or b for a, b in LINK.findall(text)]
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_picture_points_at_a_file(page):
    missing = [t for t in local_targets(page) if not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for t in local_targets(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_the_readme_shows_its_pictures_and_they_are_small():
    pictures = [t for t in local_targets(ROOT / "README.md") if t.endswith(".png")]
    assert {"docs/img/stage_graph.png", "docs/img/samples_grid.png", "docs/img/grad_heatmap.png"} <= set(pictures)
    for png in (ROOT / "docs/img").glob("*.png"):
        assert png.stat().st_size < 100_000, f"{png.name}: rerun scripts/docs_images.py, which keeps them small"


def test_the_tiny_unets_compiled_blocks_are_those_docs_training_md_counts(monkeypatch):
    """docs/TRAINING.md, "Compilation": `tiny`: N blocks, M distinct. N: the blocks compile_blocks
    compiles; M: the graphs Dynamo traces for them in a training forward (backend "eager": no compiler)."""
    import torch
    from torch._dynamo.utils import counters

    from ddpmrepro import params as P
    from ddpmrepro.model.unet import build_unet
    from ddpmrepro.runtime import compilation

    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile unsupported here")
    found = re.search(r"\(`tiny`: (\d+) blocks, (\d+)\s+distinct\)", (ROOT / "docs/TRAINING.md").read_text())
    assert found, "docs/TRAINING.md no longer counts the tiny preset's blocks: update this test"
    model = build_unet(P.ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=64), torch._inductor.config.patch(fallback_random=True), \
            torch._functorch.config.patch(donated_buffer=False):
        blocks = compilation.compile_blocks(model)
        model(torch.randn(2, 1, 8, 8), torch.tensor([3, 917]), torch.tensor([0, 1]))
    distinct = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert (int(found[1]), int(found[2])) == (len(blocks), distinct)


# `dvc exp run ... -S key=value -S 'key=a,b'` in the docs: each combination on one line, applied to the
# default params.yaml, must pass the pipeline's check. (`sample.ema_step=400` was shown while only
# snapshot steps, 375 and 422 there, are accepted: a reader's first try was refused.)
SET = re.compile(r"""-S\s+(['"]?)([a-z_]+\.[a-z_]+)=([^'"\s`]+)\1""")


def documented_experiments() -> list[tuple[str, dict]]:
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "dvc exp run" in line and "$" not in line:
                sets = [s for s in SET.findall(line) if not s[2].isupper()]  # not `=L` (a placeholder)
                if sets:
                    found.append((f"{page.name}:{n}", {key: value.split(",") for _, key, value in sets}))
    return found


EXPERIMENTS = documented_experiments()


@pytest.mark.parametrize("where, sets", EXPERIMENTS, ids=[w for w, _ in EXPERIMENTS])
def test_every_documented_experiment_passes_check_params_on_the_default_params(where, sets):
    import itertools

    import yaml

    from ddpmrepro import params as P
    from ddpmrepro.pipeline.check_params import check_pipeline

    default = yaml.safe_load((ROOT / "params.yaml").read_text())
    for values in itertools.product(*sets.values()):
        raw = {section: dict(keys) for section, keys in default.items()}
        for key, value in zip(sets, values):
            section, name = key.split(".")
            raw[section][name] = yaml.safe_load(value)  # as DVC's -S reads it
        check_pipeline(P.from_dict(raw))  # raises ParamsError, naming the key, where it is refused


def test_the_snakemake_report_captions_are_valid_restructuredtext():
    """Snakemake renders them with docutils: `|G|²` in figures.rst was read as a substitution and the
    shared report showed 18 "System Message: WARNING/2" boxes (found from outside)."""
    import io

    import docutils.core

    captions = sorted((ROOT / "workflow" / "report").glob("*.rst"))
    assert len(captions) >= 6
    for path in captions:
        warnings = io.StringIO()
        docutils.core.publish_string(path.read_text(), writer_name="html",
                                     settings_overrides={"warning_stream": warnings, "report_level": 1})
        assert warnings.getvalue() == "", (path.name, warnings.getvalue())
