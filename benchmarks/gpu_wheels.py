"""The wheels that `benchmarks/on_gpu.sh` needs on a lent GPU machine, where nothing can be fetched.

    .venv/bin/python benchmarks/gpu_wheels.py            # fills .whl/ (git-ignored), prints what to carry
    .venv/bin/python benchmarks/gpu_wheels.py --list     # only the list, nothing downloaded

The lent machine's Python (3.12, x86-64) already holds PyTorch and a long list of packages
(benchmarks/device_packages.txt, copied from the workplace's description of that image). What it
lacks is the rest of ddpmrepro's dependency tree with the `dev` extra (dvc, dvclive, snakemake,
the reference implementations the tests import, ...). This script walks that tree from the
metadata of the packages installed here (the versions requirements.lock pins), evaluated for
CPython 3.12 on Linux, leaves out what the machine has, and downloads each remaining package's
wheel for that machine without its dependencies (the tree is already resolved). A package that
publishes only a source archive is built here into a wheel (they are pure Python).

On the GPU machine, `on_gpu.sh` installs `.whl/*.whl` into /tmp/site before its parts when the
folder is there: run it with `carry: [".whl"]`. The working tree and the wheels travel together
under a 64 MiB limit, so the script prints their total.

Left out on purpose (LEFT_OUT): packages a GPU run never imports, to stay under that limit.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES = Path(__file__).with_name("device_packages.txt")
# The lent machine: CPython 3.12 on x86-64 Linux (docs of the device tool, KINDS.md).
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix"}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(24, 40)]
# snakemake imports pulp only in its scheduler's solver (scheduling/milp.py), which no GPU part runs: 16 MB.
LEFT_OUT = {"pulp"}


def device_packages(path: Path = DEVICE_PACKAGES) -> set[str]:
    """The packages the lent machine's image holds (one name a line; '#' starts a comment)."""
    names = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(n) for n in names if n}


def dependency_tree(root: str = "ddpmrepro", extras: tuple[str, ...] = ("dev",)) -> dict[str, str]:
    """{name: installed version} of `root` and everything it requires (with `extras`), as the
    installed packages' metadata says, markers evaluated for the lent machine's Python."""
    found: dict[str, str] = {}

    def walk(name: str, extras: tuple[str, ...]) -> None:
        key = canonicalize_name(name)
        if key in found:
            return
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run `make setup` first, so that its version is "
                             f"the one requirements.lock pins") from None
        found[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in ("", *extras)):
                walk(req.name, tuple(req.extras))

    walk(root, extras)
    found.pop(canonicalize_name(root))
    return found


def to_carry(tree: dict[str, str], on_device: set[str]) -> dict[str, str]:
    return {k: v for k, v in sorted(tree.items()) if k not in on_device and k not in LEFT_OUT}


def download(pins: dict[str, str], dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    have = {(canonicalize_name(w.name.split("-")[0]), w.name.split("-")[1]) for w in dest.glob("*.whl")}
    for name, version in pins.items():
        spec = f"{name}=={version}"
        if (name, version) in have:
            continue
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), spec],
                             capture_output=True, text=True)
        if got.returncode != 0:  # only a source archive published: build it here (pure Python)
            print(f"building {spec} from its source archive")
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), spec], check=True)


def tree_size(root: Path) -> int:
    """Bytes of what travels without carry: git's tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--list", action="store_true", help="print the packages to carry; download nothing")
    a = ap.parse_args()
    pins = to_carry(dependency_tree(), device_packages())
    if a.list:
        print("\n".join(f"{k}=={v}" for k, v in pins.items()))
        return
    download(pins, a.dest)
    wheels = sorted(a.dest.glob("*.whl"))
    names = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    missing = sorted(set(pins) - names)
    if missing:
        raise SystemExit(f"no wheel in {a.dest} for: {', '.join(missing)}")
    extra = sorted(names - set(pins))
    if extra:
        print(f"also in {a.dest}, not needed (remove them to save space): {', '.join(extra)}")
    size, repo = sum(w.stat().st_size for w in wheels), tree_size(ROOT)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB; with the working tree ({repo / 2**20:.1f} MiB) "
          f"{(size + repo) / 2**20:.1f} MiB of the 64 MiB that may travel")
    print('on the GPU machine: run `bash benchmarks/on_gpu.sh "$OUT"` with carry [".whl"]')


if __name__ == "__main__":
    main()
