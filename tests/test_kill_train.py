"""CI's short version of scripts/kill_train.py: random SIGKILLs, resume, bitwise-identical result."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kill_train.py"


@pytest.fixture(scope="module")
def kill_train():
    """scripts/kill_train.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("kill_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_random_kills_resume_to_the_same_bits(tmp_path, kill_train):
    result = kill_train.main(kills=3, nproc=1, seed=1, workdir=tmp_path)
    assert result["kills"] == 3 and result["launches"] == 4
    # each kill came after training had passed its target step
    assert all(at >= t for at, t in zip(result["last_checkpoint_at_each_kill"], result["kill_after_steps"]))
    assert result["bitwise_identical"] is True
    assert result["checkpoints_after"][-1] == result["steps"]


@pytest.mark.slow
def test_random_kills_of_sampling_never_leave_a_partial_output(tmp_path, kill_train):
    result = kill_train.sample_main(kills=2, nproc=1, seed=1, workdir=tmp_path)
    assert result["kills"] == 2
    assert result["kill_moments"][0].endswith("(writing)")  # the first kill lands while the output is written
    # after each kill: the earlier output or the complete new one, never a partial one (output_state
    # raises), and never none at all (the new one replaces the earlier one in one exchange)
    assert set(result["output_after_each_launch"]) <= {"earlier", "complete"}
    assert result["final"] == "complete" and result["bitwise_identical"] is True


@pytest.mark.slow
def test_a_process_group_kill_of_two_process_sampling_leaves_no_worker(tmp_path, kill_train):
    # `setsid ddpmrepro sample` with 2 processes, killed with `kill -9 -- -PGID` as soon as its workers
    # exist: the group holds the launcher and torchrun only (the workers have sessions of their own),
    # so the workers must die of their parent's death, even one that had not yet asked for it.
    import os
    import signal
    import subprocess
    import time

    import psutil
    import yaml

    root, data = kill_train._workdir_with_data(tmp_path, "")
    raw = {k: dict(v) for k, v in kill_train.PARAMS.items()}
    raw["train"].update(steps=3)
    raw["sample"] = {**kill_train.SAMPLE, "nproc": 2}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    kill_train.train_in_process(raw, data, root / "trained")
    proc = subprocess.Popen(kill_train.sample_command(root, root / "samples", 2), env=kill_train.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def workers() -> list:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:  # a short-lived child (torchrun's own helpers) may be gone by the time we look
                if "ddpmrepro.cli" in p.cmdline() and p.ppid() != proc.pid:
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    deadline = time.time() + 120
    while len(workers()) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.01)
    processes = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    alive = kill_train.still_running(processes, timeout=5)
    survivors = []
    for p in alive:
        try:
            survivors.append(p.cmdline()[:4])
            p.kill()
        except psutil.NoSuchProcess:
            continue
    assert not alive, survivors
    assert not (root / "samples").exists()
