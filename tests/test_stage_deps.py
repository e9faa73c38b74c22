"""dvc.yaml's code deps cover everything each stage's command imports, in a short list.

Missing one, editing that file would not rerun the stage and a cached result would silently come
from other code. A dep may cover more than the stage imports (a whole folder): an edit there reruns
the stage for nothing, which costs little for most stages and, for train, a resume from its last
checkpoint (the code version hashes what the loop imports, training/code_version.py), not a retrain.

What a command imports is read from the source, not listed here: the stage's `cmd` names the CLI
verb, click names its function in cli.py, and the import statements of that function, of the
helpers and decorators of cli.py it uses, of the group and of cli.py's top level, followed through
the package (imports inside functions count: an import only on an error path still runs sometimes).
"""
import ast
import inspect
import re
from pathlib import Path

import pytest
import yaml

from ddpmrepro.training.code_version import PACKAGE, import_closure, module_file

ROOT = Path(__file__).resolve().parents[1]
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
MAX_CODE_DEPS = 15  # "a short list": today's longest (evaluate: 14 before bits_per_dim.py became a stage of its own; 13 before outputs.py); about 60 entries before


def _modules_imported_by(nodes: list[ast.AST]) -> set[str]:
    """The package's modules imported by cli.py's statements `nodes` (cli.py is in the top package)."""
    out = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ddpmrepro")):
            target = ".".join(filter(None, ["ddpmrepro" if node.level else None, node.module]))
            out |= {target} | {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if module_file(m)}


def command_files(verb: str) -> set[str]:
    """The files (relative to the repository) that `ddpmrepro VERB` may import."""
    from ddpmrepro.cli import main

    tree = ast.parse((PACKAGE / "cli.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    top_level = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    used, todo = set(), [inspect.unwrap(main.commands[verb].callback).__name__, main.callback.__name__]
    while todo:  # the command, the group, and cli.py's functions they name (decorators and helpers)
        name = todo.pop()
        if name not in used:
            used.add(name)
            todo += [n.id for n in ast.walk(functions[name]) if isinstance(n, ast.Name) and n.id in functions]
    modules = _modules_imported_by(top_level + [functions[n] for n in used])
    files = set(import_closure(modules)) | {PACKAGE / "cli.py", PACKAGE / "__init__.py"}
    return {f.relative_to(ROOT).as_posix() for f in files}


def verb(stage: str) -> str:
    m = re.search(r"-m ddpmrepro\.cli ([\w-]+)", STAGES[stage]["cmd"])
    assert m, f"stage {stage!r}: its cmd is not `python -m ddpmrepro.cli VERB ...`"
    return m[1]


def code_deps(stage: str) -> list[str]:
    return [d for d in STAGES[stage]["deps"] if d.startswith("src/")]


def covered(dep: str) -> set[str]:
    p = ROOT / dep
    assert p.exists(), f"{dep} does not exist"
    files = p.rglob("*.py") if p.is_dir() else [p]
    return {f.relative_to(ROOT).as_posix() for f in files if "__pycache__" not in f.parts}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_code_deps_cover_what_its_command_imports(stage):
    imported = command_files(verb(stage))
    declared = set().union(*(covered(d) for d in code_deps(stage)))
    assert imported <= declared, f"stage {stage!r} imports but does not depend on {sorted(imported - declared)}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_code_dep_is_imported_and_the_list_is_short(stage):
    imported, deps = command_files(verb(stage)), code_deps(stage)
    assert [d for d in deps if not covered(d) & imported] == [], f"stage {stage!r}: deps that it does not import"
    assert len(deps) == len(set(deps)) <= MAX_CODE_DEPS
    # A folder the stage imports all of is named as the folder: a new module there needs no edit.
    whole = [d.rsplit("/", 1)[0] for d in deps if d.count("/") > 2 and covered(d.rsplit("/", 1)[0]) <= imported]
    assert whole == [], f"stage {stage!r}: name these folders instead of their files: {sorted(set(whole))}"


def test_the_imports_are_read_from_the_commands_own_code():
    """The reading can fail: report's command imports the report and the tables but not the
    training, train's the training loop and the launcher but not the report."""
    report, train = command_files("report"), command_files("train")
    assert {"src/ddpmrepro/evaluation/report.py", "src/ddpmrepro/tables.py"} <= report
    assert not [f for f in report if f.startswith("src/ddpmrepro/training/")]
    assert {"src/ddpmrepro/training/loop.py", "src/ddpmrepro/runtime/launch.py"} <= train
    assert "src/ddpmrepro/evaluation/report.py" not in train
    assert "src/ddpmrepro/evaluation/metrics.py" not in command_files("check-params")


@pytest.mark.parametrize("params_file", ["params.yaml", *sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))])
def test_every_dvc_param_key_is_in_params_yaml_and_each_config(params_file):
    """DVC reads a stage's `params:` keys from the file itself (not our defaults) and stops the
    repro when one is missing ("Parameters 'train.import_from' are missing"). The configs/ files
    are copied over params.yaml as they are, so they must hold every key too."""
    path = ROOT / params_file if params_file == "params.yaml" else ROOT / "configs" / params_file
    raw = yaml.safe_load(path.read_text())
    for name, stage in STAGES.items():
        for entry in stage.get("params", []):
            if isinstance(entry, dict):  # {other_file.yaml: [...]}: not params.yaml
                continue
            node = raw
            for part in entry.split("."):
                assert isinstance(node, dict) and part in node, f"{name}: '{entry}' is not in {params_file}"
                node = node[part]


def test_bytecode_caches_go_to_the_venv_not_beside_the_sources(tmp_path):
    """The cascade (a DVC subrepo) hashes ../src/ddpmrepro whole, and a subrepo's .dvcignore does
    not reach outside it (treeverse/dvc#11044): one .pyc beside the sources would rerun all of its
    stages. `make setup` installs scripts/pycache_prefix.pth.txt, which sends Python's caches to
    .venv/pycache. Checked with bytecode writing on (a user's default; this CI sets
    PYTHONDONTWRITEBYTECODE), and against the same import with the prefix taken away, which does
    write beside the sources."""
    import os
    import shutil
    import subprocess
    import sys

    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():
        pytest.skip("not running in the project's .venv, where `make setup` installs the .pth")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    imports = "import ddpmrepro.cli, ddpmrepro.training.loop"
    for prefix_kept in (True, False):
        src = shutil.copytree(ROOT / "src", tmp_path / f"src-{prefix_kept}",
                              ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        code = imports if prefix_kept else "import sys; sys.pycache_prefix = None; " + imports
        subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(src)}, check=True)
        beside = list(src.rglob("*.pyc"))
        if prefix_kept:
            assert not beside, beside[:3]
            moved = venv / "pycache" / str(src.resolve()).lstrip("/") / "ddpmrepro"
            assert list(moved.glob("cli.*.pyc")), moved
        else:
            assert any(p.name.startswith("cli.") for p in beside)


@pytest.mark.parametrize("stage", sorted(set(STAGES) - {"check_params"}))
def test_every_stage_runs_after_check_params(stage):
    """DVC removes a stage's outputs before running it, in the order of the stage graph: a stage
    that depends on none of check_params' resolved files may run before the check and lose its
    outputs to a bad params.yaml that the check would have refused."""
    resolved = {next(iter(o)) if isinstance(o, dict) else o for o in STAGES["check_params"]["outs"]}
    assert resolved & set(STAGES[stage]["deps"]), f"stage {stage!r} depends on no file of {sorted(resolved)}"
