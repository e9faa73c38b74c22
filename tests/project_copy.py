"""A copy of the project's pipeline files in a temporary directory, for the end-to-end tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_FILES = ["src", "dvc.yaml", "Snakefile", "workflow", "profiles", ".dvcignore", ".gitignore", "pyproject.toml",
                  "models/published"]  # a dep of the train stage (train.import_from)


def copy_project(dest: Path, extra: tuple[str, ...] = ()) -> Path:
    """Copies the pipeline files (and `extra` ones) from the checkout to dest, without caches."""
    for name in [*PIPELINE_FILES, *extra]:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


# --- the tiny pipeline of the end-to-end tests (tests/test_pipeline.py, tests/test_browser.py) -----

BIN = str(Path(sys.executable).parent)
TINY = {
    "train": {"steps": 12, "batch_per_proc": 32, "warmup_steps": 2, "checkpoint_every": 5, "log_every": 4,
              "timestep_sampler": "loss-second-moment"},
    "diffusion": {"timesteps": 50},
    "introspect": {"every": 4, "steps": [1]},
    "sample": {"per_class": 3, "respacing": "ddim5", "batch_size": 16},
    "evaluator": {"epochs": 1},
    "evaluate": {"bpd_images": 4},
}


def run(repo: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = deep_update(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


def tiny_project(dest: Path) -> Path:
    """The project in a fresh git + DVC repo at dest, params.yaml shrunk to TINY, committed, not yet run."""
    copy_project(dest)
    params = deep_update(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(dest, "git", "init", "-q", "-b", "main")
    run(dest, "dvc", "init", "-q")
    shutil.copy2(ROOT / ".dvc" / "config", dest / ".dvc" / "config")  # the project's cache link types
    run(dest, "git", "add", "-A")
    run(dest, "git", "commit", "-qm", "tiny pipeline")
    return dest
