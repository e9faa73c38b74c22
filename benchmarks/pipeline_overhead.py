"""Wall time of the pipeline tools when there is nothing to do: `dvc repro` and `snakemake -n`.

    make repro && PYTHONPATH=src python benchmarks/pipeline_overhead.py

Run it in a checkout whose pipeline is up to date (after `make repro`): both commands must find
nothing to run, which the script checks before it reports. Medians of --repeats runs each.
Writes benchmarks/results/pipeline_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "dvc repro (no-op)": (["dvc", "repro"], ("Data and pipelines are up to date",)),
    "dvc status": (["dvc", "status"], ("Data and pipelines are up to date",)),
    "snakemake -n (no-op)": (["snakemake", "-n"], ("Nothing to be done",)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_overhead.json"))
    a = ap.parse_args()
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "DVC_NO_ANALYTICS": "1"}
    results = {}
    for name, (cmd, expect) in COMMANDS.items():
        if shutil.which(cmd[0], path=env["PATH"]) is None:
            sys.exit(f"{cmd[0]} not found; run `make setup` first")
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0 or not any(e in proc.stdout + proc.stderr for e in expect):
                sys.exit(f"`{' '.join(cmd)}` had work to do or failed (rc {proc.returncode}); run `make repro` "
                         f"first.\n{(proc.stdout + proc.stderr)[-1500:]}")
        results[name] = {"median_s": statistics.median(times), "all_s": times}
        print(f"{name:22} {statistics.median(times):6.2f} s (median of {a.repeats})", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": "PYTHONPATH=src python benchmarks/pipeline_overhead.py",
                                 "machine": platform.machine(), "cpu_count": os.cpu_count(),
                                 "results": results}, indent=2) + "\n")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
