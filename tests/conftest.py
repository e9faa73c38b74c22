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
# Inductor's kernels of the compile tests (hundreds of MB) likewise, not left in /tmp/torchinductor_$USER.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ddpmrepro-tests-inductor-"))
if os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir()):
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)
# No machine-wide CPU-core locks from the test processes (cpu_slots): tests that run several
# ddpmrepro processes at once would take turns, and concurrent test runs would wait for each other.
# tests/test_cpu_slots.py and the sweep test turn it on with a lock directory of their own.
os.environ["DDPMREPRO_CPU_SLOTS"] = "0"
# Temp git repos in the end-to-end tests need an identity even on a bare CI machine.
for key, value in {"GIT_AUTHOR_NAME": "ddpmrepro tests", "GIT_AUTHOR_EMAIL": "tests@ddpmrepro.invalid",
                   "GIT_COMMITTER_NAME": "ddpmrepro tests", "GIT_COMMITTER_EMAIL": "tests@ddpmrepro.invalid"}.items():
    os.environ.setdefault(key, value)


# Disk: the suite's temporary directories (trained tiny models, DVC repos and caches, SLURM spools)
# filled about 1.8 GB when each was kept to the end of the run, and a CI machine shares its disk (stop
# 54's CI ran out of it). So a passing test's tmp_path goes at its teardown (pyproject:
# tmp_path_retention_policy), and a module's own directories (tmp_path_factory) at the end of the
# module unless one of its tests failed: the whole suite then peaked at 0.56 GB (sampled every 20 s,
# 2026-12-07), beside the 6.4 GB virtual environment.
PEAK_GB = 1


def pytest_report_header(config):
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    line = f"free disk under {tempfile.gettempdir()}: {free:.1f} GB (the suite needs about {PEAK_GB} GB)"
    return line if free > PEAK_GB else f"WARNING: {line}: expect 'No space left on device' errors"


_failed_modules = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _failed_modules.add(item.module.__name__)
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_tmp_dirs_removed(request, tmp_path_factory):
    """Removes the directories a module's fixtures made with tmp_path_factory once the module is done
    (those that the session fixtures made are kept), unless a test of the module failed: then they
    stay for a look, as pytest keeps a failed test's tmp_path."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.module.__name__ in _failed_modules:
        return
    for path in set(base.iterdir()) - before:
        if path.name.startswith(SESSION_DIRS):
            continue
        shutil.rmtree(path, ignore_errors=True)


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


SESSION_DIRS = ("e2e",)  # the basetemp names of the session fixtures' directories, kept to the end


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The project on tiny params in a fresh git + DVC repo, after one `dvc repro`: `.repo` and
    `.first_repro` (that run's output). Built once per session: tests/test_pipeline.py goes on to edit
    and rerun it, tests/test_browser.py opens its HTML outputs."""
    from types import SimpleNamespace

    from project_copy import run, tiny_project

    repo = tiny_project(tmp_path_factory.mktemp("e2e"))
    return SimpleNamespace(repo=repo, first_repro=run(repo, "dvc", "repro").stdout)
