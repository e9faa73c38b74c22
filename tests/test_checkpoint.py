"""Checkpoints are atomic, verified before loading, and never execute pickled code."""
import os
import pickle

import pytest
import torch

from ddpmrepro import checkpoint as C


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
    (tmp_path / "step_000000001.sha256").write_text(C.sha256_file(path))  # even with a matching sidecar
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
    C.save_weights(w, tmp_path / "m.safetensors")
    back = C.load_weights(tmp_path / "m.safetensors")
    assert all(torch.equal(w[k], back[k]) for k in w)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(C.CheckpointError, match="not a valid safetensors"):
        C.load_weights(tmp_path / "bad.safetensors")
    with pytest.raises(C.CheckpointError, match="not found"):
        C.load_weights(tmp_path / "missing.safetensors")


def test_run_lock_refuses_a_second_writer(tmp_path):
    with C.RunLock(tmp_path):
        with pytest.raises(C.CheckpointError, match="another process"):
            with C.RunLock(tmp_path):
                pass
    with C.RunLock(tmp_path):  # released
        pass
