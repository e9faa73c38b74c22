"""files.py: one atomic file write, one directory swap, one sha256.

The kill tests run `replace_dir` in a child process that SIGKILLs itself at the dangerous instants
(just before and just after each rename or exchange), by wrapping the os-level call in the child
only, then look at what a reader finds: the complete old directory or the complete new one.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ddpmrepro import files as F
from ddpmrepro.outputs import OutputKind, OutputRefused

SRC = Path(__file__).resolve().parents[1] / "src"
OLD = {"a.txt": b"old a", "sub/c.txt": b"old c" * 1000, "b.bin": b"\x00old"}
NEW = {"a.txt": b"new a", "d.txt": b"new d", "sub/e/f.txt": b"new f" * 999}
KIND = OutputKind("a test output", (frozenset({"a.txt"}),))  # what both trees are


def make(root: Path, tree: dict[str, bytes]) -> Path:
    for name, data in tree.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def read(root: Path) -> dict[str, bytes]:
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def siblings(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir())


# The child: wraps the exchange (or, with the exchange refused, os.rename) so that the process
# SIGKILLs itself before or after the n-th call, then replaces `dst` with `src`.
CHILD = r"""
import os, signal, sys
from ddpmrepro import files as F
from ddpmrepro.outputs import OutputKind, OutputRefused

path, when, n, src, dst = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
calls = []

def killing(call):
    def wrapped(*args, **kwargs):
        calls.append(args)
        if when == "before" and len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        out = call(*args, **kwargs)
        if when == "after" and len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped

if path == "exchange":
    F._exchange = killing(F._exchange)
else:  # the fallback, as on a file system that cannot exchange
    F._exchange = lambda a, b: False
    os.rename = killing(os.rename)
F.replace_dir(src, dst)
"""


def run_child(path: str, when: str, n: int, src: Path, dst: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, path, when, str(n), str(src), str(dst)],
                          env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=60)
    return proc.returncode


def exchange_works(tmp_path: Path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir(), b.mkdir()
    try:
        return F._exchange(a, b)
    finally:
        os.rmdir(a), os.rmdir(b)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_at_the_exchange_leaves_the_complete_old_or_new_dir(tmp_path, when):
    if not exchange_works(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here (the fallback is tested below)")
    dst, src = make(tmp_path / "out", OLD), make(tmp_path / ".out.tmp", NEW)
    assert run_child("exchange", when, 1, src, dst) == -9
    # No recovery step: the directory a reader opens is whole at every instant.
    assert read(dst) == (OLD if when == "before" else NEW)
    # The next write cleans up whatever the kill left beside it.
    with F.replacing_dir(dst, KIND) as tmp:
        make(tmp, NEW)
    assert read(dst) == NEW and siblings(dst) == ["out"]


# The fallback's renames: 1 puts the old directory aside, 2 puts the new one in, 3 moves the old
# one to the trash name it is deleted under.
@pytest.mark.parametrize("when,n,expected,missing_until_recovered", [
    ("before", 1, OLD, False),
    ("after", 1, OLD, True),   # the one instant the fallback has no `dst`: recover_dir puts the old one back
    ("before", 2, OLD, True),
    ("after", 2, NEW, False),
    ("after", 3, NEW, False),
])
def test_a_kill_in_the_fallback_swap_is_recovered(tmp_path, when, n, expected, missing_until_recovered):
    dst, src = make(tmp_path / "out", OLD), make(tmp_path / ".out.tmp", NEW)
    assert run_child("fallback", when, n, src, dst) == -9
    assert dst.exists() is not missing_until_recovered
    F.recover_dir(dst)  # what every writer, and the model directory's reader, calls first
    assert read(dst) == expected
    with F.replacing_dir(dst, KIND) as tmp:
        make(tmp, NEW)
    assert read(dst) == NEW and siblings(dst) == ["out"]


def test_the_fallback_swap_without_a_kill(tmp_path, monkeypatch):
    dst = make(tmp_path / "out", OLD)
    monkeypatch.setattr(F, "_exchange", lambda a, b: False)
    with F.replacing_dir(dst, KIND) as tmp:
        make(tmp, NEW)
    assert read(dst) == NEW and siblings(dst) == ["out"]


def test_replacing_dir_creates_replaces_and_leaves_dst_alone_on_error(tmp_path):
    dst = tmp_path / "deep" / "out"
    with F.replacing_dir(dst, KIND) as tmp:
        assert tmp == tmp_path / "deep" / ".out.tmp" and not any(tmp.iterdir())
        make(tmp, OLD)
    assert read(dst) == OLD
    with pytest.raises(RuntimeError, match="half way"):
        with F.replacing_dir(dst, KIND) as tmp:
            make(tmp, NEW)
            raise RuntimeError("half way")
    assert read(dst) == OLD and siblings(dst) == ["out"]
    (tmp_path / "deep" / ".out.tmp").mkdir()  # a killed writer's leftover
    make(tmp_path / "deep" / ".out.tmp", {"stale": b"x"})
    with F.replacing_dir(dst, KIND) as tmp:
        make(tmp, NEW)
    assert read(dst) == NEW and siblings(dst) == ["out"]


def copy_dir(src: Path, dst: Path, kind) -> None:
    """`dst` replaced by a copy of `src`, as train exports its run directory's tables and logs."""
    with F.replacing_dir(dst, kind) as tmp:
        F.copy_into(src, tmp, shown=dst)


def test_copy_dir_keeps_its_source(tmp_path):
    src, dst = make(tmp_path / "work", NEW), make(tmp_path / "out", OLD)
    copy_dir(src, dst, KIND)
    assert read(dst) == NEW == read(src)


def test_replacing_dir_refuses_a_directory_of_another_kind_before_the_block_runs(tmp_path, monkeypatch):
    """Replacing deletes the old directory: only a missing, empty or same-kind one may go. A folder
    of someone's files, the working directory and the ones above it stay, whole."""
    theirs = make(tmp_path / "thesis", {"chapter1.tex": b"years of work"})
    ran = []
    with pytest.raises(OutputRefused, match=r"thesis: is not empty and is not a test output \(it has no a.txt\)"):
        with F.replacing_dir(theirs, KIND):
            ran.append(1)
    assert not ran and read(theirs) == {"chapter1.tex": b"years of work"} and siblings(theirs) == ["thesis"]

    project = make(tmp_path / "project", {"a.txt": b"looks like an output", "params.yaml": b"x"})
    monkeypatch.chdir(project)
    with pytest.raises(OutputRefused, match="is the working directory or one above it"):
        copy_dir(theirs, tmp_path, KIND)
    with pytest.raises(OutputRefused, match="is the working directory; "):
        copy_dir(theirs, Path("."), KIND)  # even one its kind recognises
    assert read(project) == {"a.txt": b"looks like an output", "params.yaml": b"x"}

    (tmp_path / "empty").mkdir()
    copy_dir(theirs, tmp_path / "empty", KIND)  # empty: nothing to lose
    assert read(tmp_path / "empty") == read(theirs)
    (tmp_path / "a_file").write_bytes(b"x")
    with pytest.raises(OutputRefused, match="a_file: is a file"):
        copy_dir(theirs, tmp_path / "a_file", KIND)


def test_each_output_kind_recognises_what_its_writer_leaves_and_no_other_kind_does():
    """The signatures against the directory listings of a real run (`make repro`'s outputs, as in
    the README's table): each kind recognises its own and none of the others, so no stage can
    replace another stage's output."""
    from ddpmrepro import outputs

    listings = {
        outputs.PREPARED: ["manifest.json", "test-00000.images.npy", "test-00000.labels.npy",
                           "train-00000.images.npy", "train-00000.labels.npy"],
        outputs.EVALUATOR: ["config.json", "metrics.json", "model.safetensors"],
        outputs.MODEL: ["SHA256SUMS", "config.json", "ema_0.999.safetensors", "model.safetensors", "phema"],
        outputs.TRAIN_LOG: ["metrics.json", "plots"],
        outputs.INTROSPECTION: ["act_grads", "loss_weight", "noise_levels", "param_grads", "steps", "steps.tsv"],
        outputs.SAMPLES: ["grid.png", "params.yaml", "samples.npz", "sampling.json"],
        outputs.DIFFUSERS: ["model_index.json", "scheduler", "unet"],
    }
    for kind, names in listings.items():
        assert [k.name for k in listings if k.recognises(names)] == [kind.name]
    # an imported model (no model.safetensors) and a run without introspection steps
    assert outputs.MODEL.recognises(["SHA256SUMS", "config.json", "ema_0.9999.safetensors"])
    assert outputs.INTROSPECTION.recognises(["steps.tsv"])
    project = ["Makefile", "README.md", "dvc.yaml", "params.yaml", "data", "models", "reports", "src"]
    assert not any(kind.recognises(project) for kind in listings)

def test_replace_dir_fsyncs_the_new_files_and_the_parent_before_the_swap(tmp_path, monkeypatch):
    dst, src = make(tmp_path / "out", OLD), make(tmp_path / ".out.tmp", NEW)
    events = []
    real_fsync, real_exchange = os.fsync, F._exchange
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(F, "_exchange", lambda a, b: (events.append("swap"), real_exchange(a, b))[1])
    F.replace_dir(src, dst)
    before = events[:events.index("swap")] if "swap" in events else events
    for name in NEW:  # every new file, its directories, and the parent holding src's entry
        assert str(src / name) in before, name
    assert str(src / "sub" / "e") in before and str(tmp_path) in before
    assert events[-1] == str(tmp_path)  # the swap itself is made durable


def test_atomic_write_replaces_whole_and_fsyncs_the_directory(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    path.write_text("old")
    synced = []
    monkeypatch.setattr(F, "fsync_dir", lambda p: synced.append(Path(p)))

    def fails_half_way(f):
        f.write(b"half")
        raise ValueError("the writer failed")
    with pytest.raises(ValueError):
        F.atomic_write_bytes(path, fails_half_way)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["x.json"] and synced == []
    F.atomic_write_text(path, "new")
    assert path.read_text() == "new" and synced == [tmp_path]


def test_save_weights_writes_what_safetensors_writes_and_fsyncs_the_directory(tmp_path, monkeypatch):
    w = {"a": torch.randn(3, 4), "b": torch.arange(5), "t": torch.randn(4, 3).t()}  # t: not contiguous
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp_path / "direct.safetensors"), metadata={"k": "v"})
    synced = []
    monkeypatch.setattr(F, "fsync_dir", lambda p: synced.append(Path(p)))
    F.save_weights(w, tmp_path / "ours.safetensors", metadata={"k": "v"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    assert synced == [tmp_path]
    assert sorted(os.listdir(tmp_path)) == ["direct.safetensors", "ours.safetensors"]


def test_sha256_is_hashlibs_over_block_boundaries(tmp_path):
    for size in (0, 1, 4 << 20, (4 << 20) + 3):
        data = os.urandom(size)
        (tmp_path / "f").write_bytes(data)
        assert F.sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_importing_files_loads_no_torch():
    code = "import sys, ddpmrepro.files; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], env={**os.environ, "PYTHONPATH": str(SRC)},
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) is False


def test_files_written_together_are_all_replaced_or_none(tmp_path):
    """metrics.json and its detail: a failure writing the second (here its folder is a file; a full
    disk or a read-only mount alike) leaves the first as it was, never a new headline beside an old
    detail (found from outside with a read-only --detail)."""
    from ddpmrepro.files import atomic_write_texts

    headline, blocker = tmp_path / "metrics.json", tmp_path / "reports"
    headline.write_text("old\n")
    blocker.write_text("a file where the detail's folder would be\n")
    with pytest.raises(OSError):
        atomic_write_texts({headline: "new\n", blocker / "detail.json": "new detail\n"})
    assert headline.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "reports"]  # no temp file left
    blocker.unlink()
    atomic_write_texts({headline: "new\n", blocker / "detail.json": "new detail\n"})
    assert headline.read_text() == "new\n" and (blocker / "detail.json").read_text() == "new detail\n"


def test_a_directory_holding_only_dvcs_gitignore_is_replaced_and_the_gitignore_kept(tmp_path):
    """Once DVC has removed a killed stage's outputs, reports/train/live holds only DVC's git-tracked
    `.gitignore` (listing metrics.json): the rerun `dvc exp run` was refused as "not a dvclive
    directory" (found from outside). It is an output's place: replaced, and its `.gitignore` kept."""
    dst = make(tmp_path / "out", {".gitignore": b"/metrics.json\n"})
    with F.replacing_dir(dst, KIND) as tmp:
        make(tmp, NEW)
    assert read(dst) == {**NEW, ".gitignore": b"/metrics.json\n"} and siblings(dst) == ["out"]
    with F.replacing_dir(dst, KIND) as tmp:  # a writer's own .gitignore wins
        make(tmp, {**NEW, ".gitignore": b"mine\n"})
    assert read(dst)[".gitignore"] == b"mine\n"
    theirs = make(tmp_path / "theirs", {".gitignore": b"x\n", "notes.txt": b"mine"})
    with pytest.raises(OutputRefused, match="is not empty and is not a test output"):
        with F.replacing_dir(theirs, KIND):
            pass


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_weights_and_texts_get_the_mode_the_umask_gives_as_open_would(tmp_path, umask):
    """safetensors creates its files 0600 whatever the umask: a model directory, an export or a DVC
    cache on a shared cluster was unreadable to the group (found from outside)."""
    code = (f"import os, stat, sys; os.umask({umask}); sys.path.insert(0, {str(F.__file__.rsplit('/ddpmrepro', 1)[0])!r})\n"
            "import torch\nfrom ddpmrepro import files\n"
            f"files.save_weights({{'w': torch.zeros(3)}}, {str(tmp_path / 'w.safetensors')!r})\n"
            f"files.atomic_write_text({str(tmp_path / 'c.json')!r}, '{{}}')\n"
            f"open({str(tmp_path / 'plain')!r}, 'w').close()\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(["w.safetensors", "c.json", "plain"], oct(0o666 & ~umask)), modes
