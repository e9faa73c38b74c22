"""What every benchmark script does with its result: record the exact command, write the JSON."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def command_line(script: str, args: argparse.Namespace, skip: tuple[str, ...] = ("out",)) -> str:
    """The command that reproduces this run, every option spelled out."""
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in skip)
    return f"PYTHONPATH=src python benchmarks/{script} {opts}"


def write_result(result: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")
    return out
