"""dvc.yaml's code deps are complete: every ddpmrepro module a stage imports is one of its deps.

Otherwise editing that module would not rerun the stage, and a cached result would silently
come from other code.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENTRY = {  # the modules each stage's command runs (always through the CLI)
    "check_params": ["ddpmrepro.cli", "ddpmrepro.pipeline.check_params"],
    "prepare": ["ddpmrepro.cli", "ddpmrepro.data"],
    "fit_evaluator": ["ddpmrepro.cli", "ddpmrepro.evaluator", "ddpmrepro.data", "ddpmrepro.cpu_slots"],
    "train": ["ddpmrepro.cli", "ddpmrepro.train", "ddpmrepro.launch", "ddpmrepro.gpu_slots", "ddpmrepro.cpu_slots",
              "ddpmrepro.torchrun"],
    "sample": ["ddpmrepro.cli", "ddpmrepro.sample", "ddpmrepro.launch", "ddpmrepro.gpu_slots", "ddpmrepro.cpu_slots",
               "ddpmrepro.torchrun"],
    "evaluate": ["ddpmrepro.cli", "ddpmrepro.evaluate", "ddpmrepro.cpu_slots"],
    "report": ["ddpmrepro.cli", "ddpmrepro.report"],
}


def imported_files(modules: list[str]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
            " if n.startswith('ddpmrepro') and getattr(m, '__file__', None))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}).stdout
    return {Path(f).resolve().relative_to(ROOT).as_posix() for f in json.loads(out)}


@pytest.mark.parametrize("stage", sorted(ENTRY))
def test_stage_deps_cover_every_imported_module(stage):
    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"]
    missing = [f for f in sorted(imported_files(ENTRY[stage]))
               if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)]
    assert missing == [], f"add to stage {stage!r} deps in dvc.yaml: {missing}"


def test_every_stage_has_an_entry_here():
    assert set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]) == set(ENTRY)


def test_train_code_version_covers_exactly_the_train_stage_code():
    from ddpmrepro.train import TRAIN_CODE

    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["deps"]
    code = {d.removeprefix("src/ddpmrepro/") for d in deps if d.startswith("src/")}
    assert code == set(TRAIN_CODE)
