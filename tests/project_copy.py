"""A copy of the project's pipeline files in a temporary directory, for the end-to-end tests."""
from __future__ import annotations

import shutil
from pathlib import Path

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
