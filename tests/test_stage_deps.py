"""dvc.yaml's code deps are exact: each stage depends on precisely the ddpmrepro files its command imports.

Missing one, editing that file would not rerun the stage and a cached result would silently come from
other code; one too many, an edit reruns a stage whose code did not change (a retrain for a new
plot). A subpackage is named as a folder where the stage imports all of it, so a new module there
needs no edit here; otherwise its files are listed one by one.
"""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ddpmrepro"
ENTRY = {  # the modules each stage's command runs (always through the CLI)
    "check_params": ["ddpmrepro.cli", "ddpmrepro.pipeline.check_params"],
    "prepare": ["ddpmrepro.cli", "ddpmrepro.data"],
    "fit_evaluator": ["ddpmrepro.cli", "ddpmrepro.evaluation.evaluator", "ddpmrepro.data",
                      "ddpmrepro.runtime.cpu_slots"],
    "train": ["ddpmrepro.cli", "ddpmrepro.training.loop", "ddpmrepro.runtime.launch", "ddpmrepro.runtime.gpu_slots",
              "ddpmrepro.runtime.cpu_slots", "ddpmrepro.runtime.torchrun", "ddpmrepro.interop.model_dir"],
    "sample": ["ddpmrepro.cli", "ddpmrepro.evaluation.sample", "ddpmrepro.runtime.launch",
               "ddpmrepro.runtime.gpu_slots", "ddpmrepro.runtime.cpu_slots", "ddpmrepro.runtime.torchrun"],
    "evaluate": ["ddpmrepro.cli", "ddpmrepro.evaluation.evaluate", "ddpmrepro.runtime.cpu_slots"],
    "report": ["ddpmrepro.cli", "ddpmrepro.evaluation.report"],
}


def imported_files(modules: list[str]) -> set[str]:
    """The package's files that importing `modules` loads, in a fresh interpreter."""
    return set(_imported_files(tuple(modules)))


@functools.lru_cache
def _imported_files(modules: tuple[str, ...]) -> frozenset[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
            " if n.startswith('ddpmrepro') and getattr(m, '__file__', None))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}).stdout
    return frozenset(Path(f).resolve().relative_to(ROOT).as_posix() for f in json.loads(out))


def package_files(path: str) -> set[str]:
    p = ROOT / path
    files = p.rglob("*.py") if p.is_dir() else [p]
    return {f.relative_to(ROOT).as_posix() for f in files if "__pycache__" not in f.parts}


def exact_deps(files: set[str]) -> list[str]:
    """The shortest deps list naming exactly `files`: a folder where every file in it is imported."""
    deps: list[str] = []

    def visit(directory: Path) -> None:
        rel = directory.relative_to(ROOT).as_posix()
        if directory != PACKAGE and package_files(rel) <= files:
            deps.append(rel)
            return
        for f in sorted(directory.glob("*.py")):
            if f.relative_to(ROOT).as_posix() in files:
                deps.append(f.relative_to(ROOT).as_posix())
        for d in sorted(p for p in directory.iterdir() if p.is_dir() and p.name != "__pycache__"):
            visit(d)

    visit(PACKAGE)
    return deps


def code_deps(stage: str) -> list[str]:
    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"]
    return [d for d in deps if d.startswith("src/")]


@pytest.mark.parametrize("stage", sorted(ENTRY))
def test_stage_code_deps_are_exactly_what_it_imports(stage):
    imported = imported_files(ENTRY[stage])
    declared = set().union(*(package_files(d) for d in code_deps(stage)))
    assert declared == imported, (
        f"stage {stage!r}: not imported but declared {sorted(declared - imported)}, imported but not declared "
        f"{sorted(imported - declared)}; its code deps in dvc.yaml should read: {exact_deps(imported)}")


@pytest.mark.parametrize("stage", sorted(ENTRY))
def test_stage_code_deps_name_whole_subpackages_where_they_can(stage):
    assert code_deps(stage) == exact_deps(imported_files(ENTRY[stage]))


def test_every_stage_has_an_entry_here():
    assert set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]) == set(ENTRY)


def test_train_code_version_covers_exactly_the_train_stage_code():
    from ddpmrepro.training.loop import TRAIN_CODE

    code = {d.removeprefix("src/ddpmrepro/") for d in code_deps("train")}
    assert code == set(TRAIN_CODE)


@pytest.mark.parametrize("params_file", ["params.yaml", *sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))])
def test_every_dvc_param_key_is_in_params_yaml_and_each_config(params_file):
    """DVC reads a stage's `params:` keys from the file itself (not our defaults) and stops the
    repro when one is missing ("Parameters 'train.import_from' are missing"). The configs/ files
    are copied over params.yaml as they are, so they must hold every key too."""
    path = ROOT / params_file if params_file == "params.yaml" else ROOT / "configs" / params_file
    raw = yaml.safe_load(path.read_text())
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for entry in stage.get("params", []):
            if isinstance(entry, dict):  # {other_file.yaml: [...]}: not params.yaml
                continue
            node = raw
            for part in entry.split("."):
                assert isinstance(node, dict) and part in node, f"{name}: '{entry}' is not in {params_file}"
                node = node[part]
