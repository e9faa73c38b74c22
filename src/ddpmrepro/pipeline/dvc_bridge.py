"""DVC stages -> plain records that the Snakefile turns into rules.

dvc.yaml stays the single source of truth (cmd, deps, params, outs); the stages are read
through DVC's own API so `${...}` templating, `foreach` and `matrix` resolve exactly as DVC
resolves them. Snakemake-only knobs live in each stage's `meta.snakemake` block, which DVC
ignores when hashing a stage (`report:` there says which outputs `snakemake --report` shows,
with which caption).

Staleness is DVC's call: `stages_to_run` is `dvc status` plus everything downstream of it.
The Snakefile touches a stamp input for exactly those stages and marks the inputs of every
other stage `ancient`, so Snakemake schedules what DVC would run and nothing more. One
exception, declared in dvc.yaml: a stage with `meta.snakemake.no_propagation` does not make its
descendants stale by running (check_params: the Snakefile brings its outputs up to date while it
parses, so DVC's status already names the stages they make stale).
"""
from __future__ import annotations

import os
import sys
import re
from dataclasses import dataclass, field
from pathlib import Path

IGNORED_PARTS = {"__pycache__"}
IGNORED_SUFFIXES = {".pyc", ".pyo"}


@dataclass(frozen=True)
class Out:
    path: str
    kind: str  # outs | metrics | plots
    is_dir: bool = False
    persist: bool = False
    cache: bool = True  # false: tracked by git, not by DVC's cache


@dataclass(frozen=True)
class StageSpec:
    name: str  # DVC stage name ('@' for foreach/matrix items)
    rule: str  # a Snakemake-safe rule name
    cmd: str
    deps: list[str]
    outs: list[Out]
    threads: int = 1
    resources: dict = field(default_factory=dict)
    run_cacheable: bool = True
    report: dict = field(default_factory=dict)  # out path -> Snakemake report() arguments
    local: bool = False  # run where Snakemake runs, never submitted to a cluster


def rule_name(stage_name: str) -> str:
    return re.sub(r"\W", "_", stage_name)


def load_stages(root: str | os.PathLike = ".") -> list[StageSpec]:
    """The pipeline's stages with a command, in DVC's order."""
    from dvc.repo import Repo

    root = Path(root).resolve()
    specs = []
    with Repo(os.fspath(root)) as repo:
        for stage in repo.index.stages:
            if not stage.cmd:  # `.dvc` data sources are inputs, not rules
                continue
            meta = (stage.meta or {}).get("snakemake") or {}
            hinted_dirs = set(meta.get("directories") or [])
            deps = [d.def_path for d in stage.deps if type(d).__name__ != "ParamsDependency"]
            outs = []
            for o in stage.outs:
                kind = "metrics" if o.metric else "plots" if o.plot else "outs"
                is_dir = o.def_path in hinted_dirs or (root / o.def_path).is_dir()
                outs.append(Out(o.def_path, kind, is_dir, bool(o.persist), bool(o.use_cache)))
            cmd = stage.cmd if isinstance(stage.cmd, str) else " && ".join(stage.cmd)
            specs.append(StageSpec(
                name=stage.name, rule=rule_name(stage.name), cmd=cmd, deps=deps, outs=outs,
                threads=int(meta.get("threads", 1)), resources=dict(meta.get("resources") or {}),
                run_cacheable=not stage.always_changed and not any(o.persist for o in outs),
                report=dict(meta.get("report") or {}),
                local=bool(meta.get("local", False)),
            ))
    return specs


def expand_source_dir(path: str, produced: set[str]) -> list[str]:
    """Snakemake looks only at a directory's own mtime (editing a file inside does not
    trigger a rerun; creating __pycache__ does), so source directories become their files.
    Directories that a stage produces stay whole: they connect the DAG."""
    p = Path(path)
    if path in produced or not p.is_dir():
        return [path]
    return sorted(str(f) for f in p.rglob("*")
                  if f.is_file() and not (IGNORED_PARTS & set(f.parts)) and f.suffix not in IGNORED_SUFFIXES)


def is_dry_run(workflow) -> bool:
    """`snakemake -n`, known while the Snakefile is parsed (its executor is chosen only after)."""
    settings = getattr(workflow, "output_settings", None)
    return bool(settings is not None and settings.dryrun)


def stages_to_run(root: str | os.PathLike = ".") -> dict[str, object]:
    """Stages DVC would (re)run: those `dvc status` reports, plus their descendants (none for a
    stage marked `no_propagation`)."""
    import networkx as nx
    from dvc.lock import LockError
    from dvc.repo import Repo

    with Repo(os.fspath(root)) as repo:
        try:
            dirty = repo.status()
        except LockError as e:  # a `dvc repro` (or exp run) is writing: what is stale is not known yet
            blocker = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), "another dvc")
            print(f"Error: DVC is running in this project ({blocker}), so what it would run cannot be known "
                  "now; wait for it to finish, then run snakemake again", file=sys.stderr)
            raise SystemExit(1) from None
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        by_name = {s.addressing.split(":")[-1]: s for s in graph.nodes if s.cmd}
        result: dict[str, object] = {}
        for name, why in dirty.items():
            if name not in by_name:
                continue
            result[name] = why
            stage = by_name[name]
            if ((stage.meta or {}).get("snakemake") or {}).get("no_propagation"):
                continue
            for s in nx.ancestors(graph, stage):
                if s.cmd:
                    result.setdefault(s.addressing.split(":")[-1], "upstream changed")
    return result
