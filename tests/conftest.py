import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/fake_datasets.py and friends

os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# Verification stamps of prepared data (ddpmrepro.data.verify) go to a throwaway cache, not ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ddpmrepro-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# No machine-wide CPU-core locks from the test processes (cpu_slots): tests that run several
# ddpmrepro processes at once would take turns, and concurrent test runs would wait for each other.
# tests/test_cpu_slots.py and the sweep test turn it on with a lock directory of their own.
os.environ["DDPMREPRO_CPU_SLOTS"] = "0"
# Temp git repos in the end-to-end tests need an identity even on a bare CI machine.
for key, value in {"GIT_AUTHOR_NAME": "ddpmrepro tests", "GIT_AUTHOR_EMAIL": "tests@ddpmrepro.invalid",
                   "GIT_COMMITTER_NAME": "ddpmrepro tests", "GIT_COMMITTER_EMAIL": "tests@ddpmrepro.invalid"}.items():
    os.environ.setdefault(key, value)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors on a shared 2-core CPU: spinning OpenMP/BLAS threads cost far more than they give."""
    import torch
    from threadpoolctl import threadpool_limits

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The project on tiny params in a fresh git + DVC repo, after one `dvc repro`: `.repo` and
    `.first_repro` (that run's output). Built once per session: tests/test_pipeline.py goes on to edit
    and rerun it, tests/test_browser.py opens its HTML outputs."""
    from types import SimpleNamespace

    from project_copy import run, tiny_project

    repo = tiny_project(tmp_path_factory.mktemp("e2e"))
    return SimpleNamespace(repo=repo, first_repro=run(repo, "dvc", "repro").stdout)
