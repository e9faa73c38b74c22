"""The code version that guards resume: a hash of exactly the code the training loop imports.

A checkpoint resumes only under the code that wrote it (`checkpoints/<run-hash>/<code-version>/`),
because other code could continue the run with other numbers. "The code" is the static import
closure of `ddpmrepro.training.loop`: every package module that the loop, or a module it imports,
names in an import statement, at module level or inside a function (an import in a branch that
this run does not take counts too: hashing a little more is safe, hashing less is not), and the
`__init__.py` of each package on the way, which Python runs first. Not `cli.py`: editing the help
text of `export`, or any other command, must not make an interrupted training unresumable. Not a
hand list of paths either, which drifted from what the loop imports.

Read from the import statements with `ast`, not by importing (no torch here: the CLI computes
nothing with it, and tests may hash a copy of the package that is never imported).
"""
from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # src/ddpmrepro
ENTRY = "ddpmrepro.training.loop"


def module_file(name: str, root: Path = PACKAGE) -> Path | None:
    """The file of the package's module `name` (dotted, from the package's own name): a module's
    `.py`, a package's `__init__.py`; None for a name that is not a module (a function, a class)."""
    parts = name.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    py = base.with_suffix(".py")
    return py if len(parts) > 1 and py.is_file() else None


def imported_modules(name: str, root: Path = PACKAGE) -> set[str]:
    """The package's modules that module `name` imports anywhere in its file, absolute or relative."""
    path = module_file(name, root)
    # The package that relative imports start from: the module's own for an __init__.py.
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            out.add(target)
            # `from . import checkpoint` imports a module; `from .ema import init_ema` a name.
            out |= {f"{target}.{a.name}" for a in node.names if module_file(f"{target}.{a.name}", root)}
    return {m for m in out if module_file(m, root)}


def import_closure(modules: Iterable[str], root: Path = PACKAGE) -> list[Path]:
    """The files that importing `modules` may run: their imports, transitively, and every parent
    package's `__init__.py`; sorted."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # Python runs each parent package first
        todo += sorted(imported_modules(name, root) - seen)
    return sorted(module_file(m, root) for m in seen)


def code_version(root: Path = PACKAGE) -> str:
    """16 hex digits of sha256 over the training loop's import closure: each file's path relative
    to the package, then its bytes, in sorted order."""
    h = hashlib.sha256()
    for f in import_closure([ENTRY], root):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


__all__ = ["code_version", "import_closure", "imported_modules", "module_file", "ENTRY"]
