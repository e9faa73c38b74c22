"""The package's folders import each other downward only (docs/ARCHITECTURE.md, "Package map").

Read statically from every module's import statements, so an import hidden in a function counts too.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpmrepro"
# part -> the parts it may import (besides itself). A part is a subpackage or a top-level module.
ALLOWED = {
    "cli": {"params", "respace", "files", "outputs", "tables", "model_dir", "pipeline", "data", "model", "training", "runtime",
            "evaluation", "interop", "__init__", "__version__"},
    "interop": {"params", "respace", "files", "outputs", "data", "model", "model_dir"},
    # check_params holds the stages to each other (check_pipeline): the bucket rule of training/, the
    # post-hoc EMA's equations and the model's names; jobs_here the launcher's checks of this machine;
    # nothing below imports pipeline/.
    "pipeline": {"params", "respace", "files", "tables", "model", "training", "data", "runtime"},
    "training": {"params", "respace", "files", "outputs", "tables", "data", "model", "runtime", "model_dir"},
    "evaluation": {"params", "respace", "files", "outputs", "tables", "data", "model", "runtime", "model_dir"},
    "data": {"params", "respace", "files", "outputs"},
    "model": {"respace"},
    "runtime": {"files"},
    "model_dir": {"params", "respace", "files", "outputs", "model"},
    "params": {"respace"},
    "respace": set(),
    "tables": {"files"},
    "files": {"outputs"},
    "outputs": set(),
    "__init__": set(),
}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported(path: Path) -> set[str]:
    """Dotted names (below ddpmrepro) that `path` imports, absolute or relative."""
    pkg = list(path.relative_to(PACKAGE).parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "ddpmrepro":
                base = []
            else:
                continue
            mod = (node.module or "").split(".") if node.module else []
            if not node.level:
                mod = mod[1:]
            target = base + mod
            for alias in node.names:  # from a package, the name may be a module: count it as one
                out.add(".".join(target + [alias.name]) if PACKAGE.joinpath(*target).is_dir() else ".".join(target))
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("ddpmrepro.")}
    return {m for m in out if m}


def allowed(source: str, target: str) -> bool:
    top = target.split(".")[0]
    return top == source or any(target == a or target.startswith(a + ".") or top == a for a in ALLOWED[source])


def test_every_part_has_a_rule():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert parts <= set(ALLOWED), f"add these to ALLOWED (and to docs/ARCHITECTURE.md): {parts - set(ALLOWED)}"


def test_imports_go_downward_only():
    wrong = [f"{p.relative_to(PACKAGE)} imports {t}" for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
             for t in sorted(imported(p)) if not allowed(part_of(p), t)]
    assert wrong == []


def test_the_rule_can_fail():
    assert not allowed("model", "training.loop") and not allowed("runtime", "model.unet")
    assert not allowed("evaluation", "training.loop") and not allowed("evaluation", "training.introspect")
    assert allowed("evaluation", "tables") and not allowed("params", "model.unet")
    here = PACKAGE / "evaluation" / "sample.py"
    assert "model_dir" in imported(here) and "runtime.distributed" in imported(here)
