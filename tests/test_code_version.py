"""The code version that guards resume hashes what the training loop imports, and nothing else."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ddpmrepro.training.code_version import ENTRY, PACKAGE, code_version, import_closure

ROOT = Path(__file__).resolve().parents[1]


def closure_names(root: Path = PACKAGE) -> set[str]:
    return {f.relative_to(root).as_posix() for f in import_closure([ENTRY], root)}


def test_the_closure_is_the_training_code_and_not_the_cli_nor_sampling():
    names = closure_names()
    assert {"__init__.py", "training/__init__.py", "training/loop.py", "training/ema.py", "model/unet.py",
            "model/diffusion.py", "params.py", "data/prepared.py"} <= names
    assert not {"cli.py", "model/samplers.py", "runtime/launch.py"} & names
    assert not [n for n in names if n.startswith(("evaluation/", "interop/", "pipeline/"))]


def test_the_closure_holds_every_module_that_importing_the_loop_loads():
    """An independent measure: what Python itself loads in a fresh interpreter. The static closure
    may hold more (imports inside functions), never less."""
    code = ("import json, sys; import ddpmrepro.training.loop; print(json.dumps(sorted(m.__file__ for n, m in "
            "sys.modules.items() if n.startswith('ddpmrepro') and getattr(m, '__file__', None))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}).stdout
    loaded = {Path(f).resolve().relative_to(PACKAGE).as_posix() for f in json.loads(out)}
    assert loaded - {"training/code_version.py"} <= closure_names()  # (loop.py may come to import this module)


def _edited(tmp_path: Path, rel: str) -> str:
    copy = tmp_path / rel.replace("/", "_") / "ddpmrepro"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / rel, "a") as f:
        f.write("\n# an edit\n")
    return code_version(copy)


def test_an_edit_outside_the_closure_keeps_the_version_and_one_inside_changes_it(tmp_path):
    copy = tmp_path / "same" / "ddpmrepro"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    version = code_version()
    assert len(version) == 16 and int(version, 16) >= 0
    assert code_version(copy) == version  # paths are hashed relative to the package: a copy elsewhere agrees
    for outside in ("cli.py", "model/samplers.py", "evaluation/report.py"):
        assert _edited(tmp_path, outside) == version, outside
    for inside in ("training/ema.py", "model/unet.py", "data/__init__.py", "respace.py"):
        assert _edited(tmp_path, inside) != version, inside
