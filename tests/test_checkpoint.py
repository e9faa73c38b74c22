"""Checkpoints are atomic, verified before loading, and never execute pickled code."""
import os
import pickle
from pathlib import Path

import pytest
import torch

from ddpmrepro import files as F
from ddpmrepro.training import checkpoint as C


def test_save_load_and_keep_last_k(tmp_path):
    for step in (1, 2, 3):
        C.save_checkpoint({"step": step, "w": torch.full((2,), float(step))}, tmp_path, step, keep=2)
    names = [p.name for p in C.list_checkpoints(tmp_path)]
    assert names == ["step_000000002.pt", "step_000000003.pt"]
    state = C.load_checkpoint(C.latest_checkpoint(tmp_path))
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((2,), 3.0))


def test_truncated_checkpoint_is_refused(tmp_path):
    path = C.save_checkpoint({"w": torch.randn(1000)}, tmp_path, 1, keep=2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(C.CheckpointError, match="sha256 mismatch"):
        C.load_checkpoint(path)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickle_payload_is_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step_000000001.pt"
    with open(path, "wb") as f:
        torch.save({"evil": Payload()}, f, pickle_module=pickle)
    (tmp_path / "step_000000001.sha256").write_text(F.sha256(path))  # even with a matching sidecar
    with pytest.raises(C.CheckpointError, match="refused to load"):
        C.load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    C.save_checkpoint({"step": 1}, tmp_path, 1, keep=3)

    def boom(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        C.save_checkpoint({"step": 2}, tmp_path, 2, keep=3)
    monkeypatch.undo()
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step_000000001.pt"]
    assert C.load_checkpoint(C.latest_checkpoint(tmp_path))["step"] == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


def test_weights_round_trip_and_corrupt_file(tmp_path):
    w = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    F.save_weights(w, tmp_path / "m.safetensors")
    back = F.load_weights(tmp_path / "m.safetensors")
    assert all(torch.equal(w[k], back[k]) for k in w)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(C.CheckpointError, match="not a valid safetensors"):
        F.load_weights(tmp_path / "bad.safetensors")
    with pytest.raises(C.CheckpointError, match="not found"):
        F.load_weights(tmp_path / "missing.safetensors")


def test_run_lock_refuses_a_second_writer(tmp_path):
    with C.RunLock(tmp_path):
        with pytest.raises(C.CheckpointError, match="another process"):
            with C.RunLock(tmp_path):
                pass
    with C.RunLock(tmp_path):  # released
        pass


def test_run_lock_on_a_filesystem_without_flock_is_one_line(tmp_path, monkeypatch):
    """Lustre without `-o flock` answers flock(2) with ENOSYS, some NFS setups with ENOLCK: a stand-in
    for such a filesystem, which this machine has none of."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(C.CheckpointError, match=r"\.lock: cannot lock it \(Function not implemented\): its filesystem "
                                                r"has no flock; .*-o flock"):
        with C.RunLock(tmp_path):
            pass


# Torch's own wording of a refused load, which a user should never have to read (issue 17, item 7).
TORCH_WORDS = ("Weights only load failed", "weights_only", "Unsupported", "WeightsUnpickler", "`", "PytorchStreamReader")


@pytest.mark.parametrize("damage", ["pickle-payload", "not-an-archive"])
def test_a_refused_checkpoint_is_explained_in_our_words(tmp_path, damage):
    path = tmp_path / "step_000000001.pt"
    if damage == "pickle-payload":
        with open(path, "wb") as f:
            torch.save({"evil": Payload()}, f, pickle_module=pickle)
        what = "holds Python objects other than tensors"
    else:
        path.write_bytes(b"PK\x03\x04" + bytes(200))  # a zip header, then nothing torch can read
        what = "not a torch checkpoint archive that can be read"
    (tmp_path / "step_000000001.sha256").write_text(F.sha256(path))  # the sidecar matches: the load decides
    with pytest.raises(C.CheckpointError) as info:
        C.load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: refused to load: ") and what in message
    assert message.lower().endswith("delete it to resume from an earlier checkpoint")
    assert "\n" not in message and not [w for w in TORCH_WORDS if w in message], message


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_of_dead_writers_are_removed_and_a_live_writers_kept(tmp_path):
    import subprocess
    import sys

    C.save_checkpoint({"step": 1}, tmp_path, 1, keep=3)
    dead = tmp_path / f".step_000000002.pt.tmp.{_dead_pid()}"  # a writer killed mid-write
    # A live writer holds its temp file open; another live process with a leftover's pid (pid reuse) does not.
    writer = subprocess.Popen([sys.executable, "-c", f"f = open({str(tmp_path)!r} + '/.w', 'wb'); print(1, flush=True); "
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        writer.stdout.readline()  # the file is open
        live = tmp_path / f".step_000000002.pt.tmp.{writer.pid}"
        (tmp_path / ".w").rename(live)  # the writer's open file, under the name it would have
        reused = tmp_path / f".step_000000002.sha256.tmp.{bystander.pid}"
        ours = tmp_path / f".step_000000003.pt.tmp.{os.getpid()}"
        other = tmp_path / ".notes.tmp"  # not a temp file of ours: no pid
        for f in (dead, reused, ours, other):
            f.write_bytes(b"partial")
        removed = C.remove_stale_temp_files(tmp_path)
        assert sorted(removed) == sorted([dead, reused])
        assert live.exists() and ours.exists() and other.exists()
        assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step_000000001.pt"]
    finally:
        writer.kill(), bystander.kill()
        writer.wait(), bystander.wait()


def test_a_relative_root_in_a_dvc_experiments_temporary_clone_is_the_projects(tmp_path):
    """DVC runs queued experiments in <project>/.dvc/tmp/exps/<tmpdir>/ and --temp ones in
    .../exps/standalone/<tmpdir>/, and deletes the clone when they end: the checkpoints a rerun would
    resume from went with it."""
    proj = tmp_path / "proj"
    queued, standalone = proj / ".dvc/tmp/exps/tmpab12cd", proj / ".dvc/tmp/exps/standalone/tmpef34"
    for clone in (queued, standalone):
        (clone / ".dvc").mkdir(parents=True)
        (clone / "cascade").mkdir()
        assert C.project_root_for(Path("checkpoints"), cwd=clone) == proj / "checkpoints"
        # a stage with a wdir (cascade/): the same subfolder of the project
        assert C.project_root_for(Path("checkpoints"), cwd=clone / "cascade") == proj / "cascade/checkpoints"
        assert C.project_root_for(Path("/scratch/ckpt"), cwd=clone) == Path("/scratch/ckpt")  # absolute: as given
    assert C.project_root_for(Path("ckpt/x"), cwd=proj) == Path("ckpt/x")  # the workspace: as given
    assert C.project_root_for(Path("c"), cwd=proj / ".dvc/tmp/exps") == Path("c")  # not inside a clone
