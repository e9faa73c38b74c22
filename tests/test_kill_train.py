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
    # after each kill: the earlier output or the complete new one, never a partial one (output_state raises)
    assert set(result["output_after_each_launch"]) <= {"earlier", "complete", "absent"}
    assert result["final"] == "complete" and result["bitwise_identical"] is True
