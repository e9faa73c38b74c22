"""The `check_params` stage: params.yaml validated before any other stage runs.

DVC removes a stage's outputs before it runs the stage's command, so a typo caught by the
command itself (`train.bogus_key: 1`) used to cost the user `models/ddpm/` and the dvclive
files. `check_params` is the first stage of the pipeline and every other stage depends on one
of its outputs, so `dvc repro` and `dvc exp run` run it first and stop there; it depends on
the whole params.yaml file, so a misspelt section name (`trian:`) is caught too.

Its outputs are the params resolved per section (`<out>/<section>.yaml`, defaults filled in):
a stage depends on the files of the sections it reads, so editing `train.lr` changes
`train.yaml` only and prepare still does not rerun. The files are `persist` outputs: DVC
leaves them in place while the check runs, and they are rewritten only when their content
changes, so a failed check touches nothing at all.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from ..files import atomic_write_text
from ..params import Params, ParamsError, load

HEADER = "# Written by `ddpmrepro check-params` from params.yaml, defaults filled in. Do not edit.\n"


def section_files(out_dir: Path) -> dict[str, Path]:
    """The resolved-params file of every params section."""
    return {name: Path(out_dir) / f"{name}.yaml" for name in Params().to_dict()}


def write_resolved(params: Params, out_dir: Path) -> list[Path]:
    """Writes `<out_dir>/<section>.yaml` for every section whose content changed (an unchanged
    file keeps its mtime, which Snakemake reads); returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = params.to_dict()
    written = []
    for name, path in section_files(out_dir).items():
        text = HEADER + yaml.safe_dump({name: resolved[name]}, sort_keys=False)
        if not path.is_file() or path.read_text() != text:
            atomic_write_text(path, text)  # whole or absent
            written.append(path)
    return written


def check_params_file(path: str | Path = "params.yaml", out_dir: str | Path | None = None) -> Params:
    """For the Snakefile: a bad params file exits as the stages do (one line, exit code 2).

    With `out_dir` (the check_params stage's --out), the resolved files are also brought up to
    date, so that DVC's status, which the Snakefile asks next, already shows which stages a
    params edit makes stale (their resolved section changed); the check_params job then only
    records what is there.
    """
    try:
        params = load(path)
    except ParamsError as e:
        msg = str(e) if str(e).startswith(str(path)) else f"{path}: {e}"
        print(f"Error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    if out_dir is not None:
        write_resolved(params, Path(out_dir))
    return params
