"""training/stats.py: the log line's running means against a direct computation, over two ranks
(real gloo processes) and through a checkpointed state."""
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from ddpmrepro.training.stats import RunningStats


def test_means_equal_a_direct_mean_of_the_finite_values_and_of_each_group():
    torch.manual_seed(0)
    stats = RunningStats({"loss": 1, "q": 4}, torch.device("cpu"))
    batches = [torch.randn(16).abs() for _ in range(3)]
    batches[1][5] = math.inf
    batches[2][0] = math.nan
    groups = [torch.randint(0, 3, (16,)) for _ in range(3)]  # group 3 stays empty
    for v, g in zip(batches, groups):
        stats.report("loss", v, torch.isfinite(v))
        stats.report("q", v, torch.isfinite(v), group=g)
    means = stats.means()
    allv, allg = torch.cat(batches).double(), torch.cat(groups)
    ok = torch.isfinite(allv)
    # ungrouped values are summed in their dtype (float32 here, as the losses), grouped ones in float64
    assert math.isclose(means["loss"], allv[ok].mean().item(), rel_tol=1e-6)
    assert not math.isclose(means["loss"], allv[ok].mean().item() * (1 + 1e-5), rel_tol=1e-6)
    for i in range(3):
        assert math.isclose(means[f"q{i}"], allv[ok & (allg == i)].mean().item(), rel_tol=1e-12)
    assert "q3" not in means  # an empty group is left out, not logged as 0 or NaN
    # a new window starts empty
    assert math.isnan(stats.means()["loss"])


def test_a_window_resumed_from_the_state_gives_the_same_means():
    a = RunningStats({"loss": 1, "q": 2}, torch.device("cpu"))
    a.report("loss", torch.tensor([1.0, 2.0]))
    a.report("q", torch.tensor([1.0, 3.0]), group=torch.tensor([0, 1]))
    b = RunningStats({"loss": 1, "q": 2}, torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        s.report("loss", torch.tensor([6.0]))
        s.report("q", torch.tensor([5.0]), group=torch.tensor([1]))
    assert a.means() == b.means() == {"loss": 3.0, "q0": 1.0, "q1": 4.0}


WORKER = """
import json, sys, torch, torch.distributed as dist
from ddpmrepro.training.stats import RunningStats
dist.init_process_group("gloo")
r = dist.get_rank()
s = RunningStats({"loss": 1, "q": 2}, torch.device("cpu"))
v = torch.arange(4, dtype=torch.float32) + 10 * r
s.report("loss", v)
s.report("q", v, group=torch.tensor([0, 0, 1, 1]))
rows = s.state_dict()
m = s.means()
if r == 0:
    json.dump({"means": m, "rows": rows.tolist()}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_two_ranks_log_the_mean_over_both_and_checkpoint_each_ranks_sums(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(script), str(out)], check=True, env=env, capture_output=True, timeout=300)
    import json

    got = json.loads(out.read_text())
    values = torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])  # both ranks' values
    assert got["means"]["loss"] == values.mean().item()
    assert got["means"]["q0"] == values[[0, 1, 4, 5]].mean().item()
    assert got["means"]["q1"] == values[[2, 3, 6, 7]].mean().item()
    assert [row[:2] for row in got["rows"]] == [[6.0, 4.0], [46.0, 4.0]]  # each rank's own (sum, count)
