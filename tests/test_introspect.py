"""Gradient introspection checked against independent computations (autograd.grad, p.grad)."""
from __future__ import annotations

import copy
import gc
import math
import os
import socket

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpmrepro.training.introspect import (ACT_GRADS_SCHEMA, PARAM_GRADS_SCHEMA, ActivationGradRecorder, ParamGradRecorder,
                                  TableWriter, is_record_step, read_table, select_names)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster and immune to a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)

    def forward(self, x):
        return self.conv(F.silu(self.norm(x)))


class TinyNet(nn.Module):
    """UNet-like names: input_blocks.{i}, middle_block, output_blocks.{i}, out; a skip connection
    (the input of output_blocks.0 is also consumed elsewhere) and a module called twice (shared)."""

    def __init__(self, c=4, inplace=False):
        super().__init__()
        self.input_blocks = nn.ModuleList([nn.Conv2d(1, c, 3, padding=1), Block(c)])
        self.middle_block = Block(c)
        self.act = nn.ReLU(inplace=inplace)  # runs on middle_block's output
        self.output_blocks = nn.ModuleList([Block(c), Block(c)])
        self.shared = nn.Conv2d(c, c, 1)
        self.out = nn.Conv2d(c, 1, 3, padding=1)

    def forward(self, x):
        h0 = self.input_blocks[0](x)
        h1 = self.input_blocks[1](h0)
        h = self.act(self.middle_block(h1))
        h = self.output_blocks[0](h) + h1  # skip: h1 feeds two consumers
        h = self.shared(self.output_blocks[1](h))
        h = self.shared(h)  # second call of the same module
        return self.out(h)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyNet(**kw)


def batch(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randn(n, 1, 8, 8, generator=g)


def loss_fn(model, x, y):
    return (model(x) - y).square().mean()


def ref_stats(grads: list[torch.Tensor]) -> dict:
    g = torch.cat([t.detach().double().flatten() for t in grads])
    return {"l2": g.norm().item(), "mean": g.mean().item(), "std": g.std(unbiased=False).item(),
            "absmax": g.abs().max().item(), "zero_frac": (g == 0).double().mean().item(), "numel": g.numel()}


def output_grads(model, names, microbatches, scale=1.0):
    """Reference: every output of each named module, grads by torch.autograd.grad of the summed loss."""
    mods = dict(model.named_modules())
    outs = {n: [] for n in names}
    hs = [mods[n].register_forward_hook(lambda m, a, o, n=n: outs[n].append(o) and None) for n in names]
    try:
        res = {n: [] for n in names}
        for x, y in microbatches:
            for n in names:
                outs[n].clear()
            loss = loss_fn(model, x, y) / len(microbatches) * scale
            flat = [(n, o) for n in names for o in outs[n]]
            gs = torch.autograd.grad(loss, [o for _, o in flat])
            for (n, _), g in zip(flat, gs):
                res[n].append(g / scale)
        return res
    finally:
        for h in hs:
            h.remove()


def check_row(row, ref, rel=1e-5):
    for k in ("l2", "mean", "std", "absmax", "zero_frac"):
        tol = 1e-6 * ref["absmax"] if k == "mean" else 1e-12  # mean ~ 0: float32 sums cancel
        assert row[k] == pytest.approx(ref[k], rel=rel, abs=tol), k
    assert row["numel"] == ref["numel"]


# --- selection ---------------------------------------------------------------------------------


def test_select_names_globs_regex_outermost_and_errors():
    names = [n for n, _ in make().named_modules() if n]
    assert select_names(names, ["input_blocks.*", "out"], outermost=True) == ["input_blocks.0", "input_blocks.1", "out"]
    assert "input_blocks.1.conv" in select_names(names, ["input_blocks.*"])
    assert select_names(names, [r"re:output_blocks\.\d\.conv"], outermost=True) == ["output_blocks.0.conv", "output_blocks.1.conv"]
    with pytest.raises(ValueError, match="'nope\\*' matches no module"):
        select_names(names, ["out", "nope*"], what="module")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        select_names(names, ["re:("])
    assert is_record_step(50, 25, [1]) and is_record_step(1, 25, [1]) and not is_record_step(2, 0, [1])


def test_record_steps_count_completed_updates_and_include_the_last():
    # the defaults (1500 updates, every 25, steps [1]): the first update, every 25th, the last
    recorded = [s for s in range(1, 1501) if is_record_step(s, 25, [1], last=1500)]
    assert recorded == [1] + list(range(25, 1501, 25))
    # the last step is recorded even when `every` does not divide it, and never with every: 0
    assert [s for s in range(1, 11) if is_record_step(s, 4, [], last=10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if is_record_step(s, 0, [3], last=10)] == [3]


# --- parameter gradients -----------------------------------------------------------------------


def test_param_grad_norms_equal_p_grad_norm_and_true_update_ratio():
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = ParamGradRecorder(model.named_parameters(), ["*"])
    loss_fn(model, *batch(0)).backward()
    rec.capture(7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    rows, summary = rec.finish(total_norm=total, clip_threshold=0.5, lr=1e-2)
    assert [r["name"] for r in rows] == [n for n, _ in model.named_parameters()]
    for r in rows:
        p = dict(model.named_parameters())[r["name"]]
        assert r["grad_norm"] == pytest.approx(grads[r["name"]], rel=1e-6)  # before clipping
        assert r["param_norm"] == pytest.approx(before[r["name"]].norm().item(), rel=1e-6)
        if before[r["name"]].norm() == 0:  # e.g. GroupNorm bias at init: ratio undefined
            assert math.isnan(r["update_ratio"])
        else:
            ratio = (p.detach() - before[r["name"]]).norm() / before[r["name"]].norm()
            assert r["update_ratio"] == pytest.approx(ratio.item(), rel=1e-5)
        assert r["shape"] == "x".join(map(str, p.shape)) and r["numel"] == p.numel()
    assert summary["total_grad_norm"] == pytest.approx(total.item())
    assert summary["selected_grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in grads.values())), rel=1e-6)
    assert summary["clipped"] is (total.item() > 0.5) and summary["skipped"] is False and summary["step"] == 7


def test_param_grad_norms_under_grad_scaler_are_unscaled():
    model, ref = make(), make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rec = ParamGradRecorder(model.named_parameters(), ["out.*", "re:input_blocks\\.0\\..*"])
    x, y = batch(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    rec.capture(0)
    scaler.step(opt)
    scaler.update()
    rows, summary = rec.finish(loss_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(ref, x, y).backward()
    refg = dict(ref.named_parameters())
    assert {r["name"] for r in rows} == {"out.weight", "out.bias", "input_blocks.0.weight", "input_blocks.0.bias"}
    for r in rows:
        assert r["grad_norm"] == pytest.approx(refg[r["name"]].grad.norm().item(), rel=1e-4)


def test_param_recorder_missing_grad_gives_nan():
    model = make()
    rec = ParamGradRecorder(model.named_parameters(), ["*"])
    model.out.weight.grad = torch.ones_like(model.out.weight)
    rec.capture(0)
    rows, _ = rec.finish()
    by = {r["name"]: r for r in rows}
    assert by["out.weight"]["grad_norm"] == pytest.approx(model.out.weight.numel() ** 0.5)
    assert math.isnan(by["out.bias"]["grad_norm"])


# --- activation gradients ----------------------------------------------------------------------

WATCH = ["input_blocks.*", "middle_block", "output_blocks.*", "shared", "out"]


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_activation_stats_equal_autograd_grad_with_microbatches_and_scale(scale):
    model, ref = make(), make()
    mbs = [batch(2), batch(3)]
    with ActivationGradRecorder(model, WATCH, inputs=False) as rec:
        rec.arm(5, loss_scale=scale)
        for x, y in mbs:
            (loss_fn(model, x, y) / len(mbs) * scale).backward()
        rows = rec.collect()
    expect = output_grads(ref, rec.names, mbs, scale=scale)
    assert {r["module"] for r in rows} == set(rec.names)
    for r in rows:
        assert r["tensor"] == "output" and r["step"] == 5 and r["reduction"] == "global" and r["rank"] == -1
        assert r["calls"] == len(expect[r["module"]]) == (4 if r["module"] == "shared" else 2)
        check_row(r, ref_stats(expect[r["module"]]))


def test_input_grad_is_this_modules_share_only():
    """middle_block's input h1 also feeds the skip connection: the recorded input grad is J^T g_out
    through middle_block alone, not the total grad of h1."""
    model, ref = make(), make()
    x, y = batch(4)
    with ActivationGradRecorder(model, ["middle_block", "input_blocks.0"]) as rec:
        rec.arm(0)
        loss_fn(model, x, y).backward()
        rows = {(r["module"], r["tensor"]): r for r in rec.collect()}
    assert ("input_blocks.0", "input") not in rows  # the image needs no grad
    # independent: g_out by autograd.grad, then a vector-Jacobian product through the block alone
    (g_out,) = output_grads(ref, ["middle_block"], [(x, y)])["middle_block"]
    h1 = ref.input_blocks[1](ref.input_blocks[0](x)).detach().requires_grad_()
    (g_in,) = torch.autograd.grad(ref.middle_block(h1), h1, grad_outputs=g_out)
    check_row(rows[("middle_block", "input")], ref_stats([g_in]))
    (total,) = output_grads(ref, ["input_blocks.1"], [(x, y)])["input_blocks.1"]
    assert abs(total.norm().item() - g_in.norm().item()) > 1e-3 * g_in.norm().item()  # the skip adds to it


def test_inplace_relu_after_watched_module():
    """middle_block's output is overwritten by ReLU(inplace=True); the tensor hook still sees the grad
    w.r.t. the pre-ReLU value, equal to the non-inplace model's."""
    model, ref = make(inplace=True), make(inplace=False)
    x, y = batch(5)
    with ActivationGradRecorder(model, ["middle_block", "act"]) as rec:
        rec.arm(0)
        loss_fn(model, x, y).backward()
        rows = {(r["module"], r["tensor"]): r for r in rec.collect()}
    expect = output_grads(ref, ["middle_block", "act"], [(x, y)])
    check_row(rows[("middle_block", "output")], ref_stats(expect["middle_block"]))
    check_row(rows[("act", "output")], ref_stats(expect["act"]))
    assert rows[("middle_block", "output")]["zero_frac"] > 0.1  # the ReLU mask reached it
    assert ("act", "input") not in rows  # ReLU(inplace) writes into its input: not recorded (warned)
    assert ("middle_block", "input") in rows


def test_histogram_counts_log10_abs_grad():
    model, ref = make(), make()
    x, y = batch(6)
    with ActivationGradRecorder(model, ["out", "middle_block"], histogram_bins=16, hist_range=(-8.0, 0.0)) as rec:
        rec.arm(0, loss_scale=4.0)
        (loss_fn(model, x, y) * 4.0).backward()
        row = next(r for r in rec.collect() if r["module"] == "out" and r["tensor"] == "output")
    (g,) = output_grads(ref, ["out"], [(x, y)])["out"]
    lg = np.clip(np.log10(np.abs(g.double().numpy().ravel())), -8.0, 0.0)
    counts, _ = np.histogram(lg, bins=16, range=(-8.0, 0.0))
    assert sum(row["hist"]) == g.numel()
    assert np.abs(np.array(row["hist"]) - counts).sum() <= 2  # float32 vs float64 at bin edges
    # recording never alters the gradients that flow on
    (loss_fn(ref, x, y) * 4.0).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_unarmed_steps_record_nothing_and_no_grad_forward_is_ignored(monkeypatch):
    model = make()
    rec = ActivationGradRecorder(model, WATCH)
    calls = []
    monkeypatch.setattr(rec, "_accumulate", lambda slot, g: calls.append(slot))
    loss_fn(model, *batch(0)).backward()
    assert calls == [] and rec.collect() == []
    rec.arm(1)
    with torch.no_grad():
        model(batch(0)[0])
    assert calls == []
    loss_fn(model, *batch(0)).backward()
    assert calls
    rec.close()


def test_close_removes_all_handles():
    model = make()
    with ActivationGradRecorder(model, WATCH) as rec:
        assert any(m._forward_hooks for m in model.modules())
        rec.arm(0)
        loss_fn(model, *batch(0)).backward()
        rec.collect()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks


def test_dumps_capped_and_unscaled():
    model, ref = make(), make()
    x, y = batch(7)
    rec = ActivationGradRecorder(model, WATCH, dump_steps=[3], dump_modules=["out", "middle_block"],
                                 dump_max_mb=6 * 64 * 4 / 2**20)  # room for `out`'s grad only
    rec.arm(3, loss_scale=8.0)
    (loss_fn(model, x, y) * 8.0).backward()
    rec.collect()
    dumps = rec.take_dumps()
    assert list(dumps) == ["out/output/0"]  # backward reaches `out` first; middle_block's did not fit
    (g,) = output_grads(ref, ["out"], [(x, y)])["out"]
    torch.testing.assert_close(dumps["out/output/0"], g, rtol=1e-5, atol=1e-9)
    rec.arm(4)
    loss_fn(model, x, y).backward()
    rec.collect()
    assert rec.take_dumps() == {}
    rec.close()


def test_memory_flat_over_300_armed_steps():
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    act = ActivationGradRecorder(model, WATCH, histogram_bins=8)
    prm = ParamGradRecorder(model.named_parameters(), ["*"])
    x, y = batch(0)

    def live_tensors():
        gc.collect()
        return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())  # type(): no proxy __class__

    def step(i):
        act.arm(i)
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        prm.capture(i)
        opt.step()
        prm.finish()
        act.collect()

    for i in range(20):
        step(i)
    before = live_tensors()
    for i in range(20, 320):
        step(i)
    assert live_tensors() - before <= 2
    act.close()


# --- table writer ------------------------------------------------------------------------------


def fake_rows(step):
    params = [{"step": step, "name": f"p{i}", "shape": "2x3", "numel": 6, "grad_norm": step + i * 0.1,
               "param_norm": 1.0, "update_ratio": 1e-3} for i in range(3)]
    summary = {"step": step, "total_grad_norm": float(step), "selected_grad_norm": float(step),
               "clip_threshold": 1.0, "clipped": step > 1, "skipped": step == 4, "loss_scale": 1.0, "lr": 1e-3}
    act = [{"step": step, "module": "out", "tensor": "output", "reduction": "global", "rank": -1, "world_size": 1,
            "calls": 1, "numel": 10, "l2": 1.0, "mean": 0.0, "std": 0.1, "absmax": 0.5, "zero_frac": 0.0,
            "hist": [1, 2], "hist_lo": -1.0, "hist_hi": 0.0}]
    return params, summary, act


def test_writer_chunks_and_resume_drop_duplicate_steps(tmp_path):
    # Steps count completed updates: a checkpoint at step 7 holds the state after 7 updates, and
    # the rows of steps 1..7 (measured during updates 1..7) belong to it.
    w = TableWriter(tmp_path, start_step=0, flush_every=3)
    for s in range(1, 11):
        p, su, a = fake_rows(s)
        w.add(s, params=p, summary=su, activations=a, dumps={"out/output/0": torch.ones(2)} if s in (7, 8) else None)
    # crash: step 10 is still buffered; steps 1-9 are on disk in 3 chunks
    assert len(list((tmp_path / "param_grads").glob("part-*.parquet"))) == 3
    w2 = TableWriter(tmp_path, start_step=7, flush_every=3)  # resumed from the checkpoint after 7 updates
    assert sorted(read_table(tmp_path, "steps")["step"]) == list(range(1, 8))
    assert (tmp_path / "dumps" / "step-000000007.safetensors").exists()
    assert not (tmp_path / "dumps" / "step-000000008.safetensors").exists()
    for s in range(8, 13):
        p, su, a = fake_rows(s)
        w2.add(s, params=p, summary=su, activations=a)
    w2.close()
    df = pd.read_parquet(tmp_path / "param_grads")
    assert list(df.columns) == PARAM_GRADS_SCHEMA.names
    assert sorted(df["step"].unique()) == list(range(1, 13)) and len(df) == 36
    act = pd.read_parquet(tmp_path / "act_grads")
    assert list(act.columns) == ACT_GRADS_SCHEMA.names and list(act["hist"].iloc[0]) == [1, 2]
    tsv = pd.read_csv(tmp_path / "steps.tsv", sep="\t")
    assert list(tsv["step"]) == list(range(1, 13)) and tsv["skipped"].sum() == 1
    TableWriter(tmp_path, start_step=0).close()  # a fresh run starts from empty tables
    assert read_table(tmp_path, "param_grads").empty and len(pd.read_csv(tmp_path / "steps.tsv", sep="\t")) == 0


def test_checkpoints_stops_and_kills_leave_the_tables_files_as_a_run_without_them(tmp_path):
    """Chunks end where flush_every or max_rows say, never at a checkpoint: a checkpoint's snapshot
    writes the buffered rows and keeps them, and a run resumed from it reads them back (the
    checkpoint's `unflushed_from`). Found from outside: a resumed run's reports/introspect had
    other chunks, so another md5 in dvc.lock. Kills before and after the next chunk replaced the
    snapshot, and between its write and the snapshot's removal, end in the same bytes."""
    def rows(w, steps):
        for s in steps:
            p, su, a = fake_rows(s)
            w.add(s, params=p, summary=su, activations=a)

    def files(d):
        return {f.relative_to(d).as_posix(): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
    ref = tmp_path / "ref"
    w = TableWriter(ref, start_step=0, flush_every=10)
    rows(w, range(1, 31))
    w.close()
    assert sorted(f.name for f in (ref / "steps").iterdir()) == [
        "part-000000001-000000010.parquet", "part-000000011-000000020.parquet", "part-000000021-000000030.parquet"]

    for killed_at, crash_in_flush in ((17, False), (25, False), (25, True)):
        d = tmp_path / f"run{killed_at}{crash_in_flush}"
        w = TableWriter(d, start_step=0, flush_every=10)
        rows(w, range(1, 14))
        w.snapshot()  # the checkpoint at step 13 (a stop, or checkpoint_every) notes:
        unflushed_from = w.unflushed_from
        assert unflushed_from == 11 and (d / "steps/part-000000011-000000013.parquet").exists()
        rows(w, range(14, killed_at + 1))  # to 17: still buffered; to 25: the chunk 11-20 replaced the snapshot
        if crash_in_flush:  # killed between the chunk's write and the snapshot's removal
            (d / "steps/part-000000011-000000013.parquet").write_bytes((ref / "steps/part-000000001-000000010.parquet").read_bytes())
        w = TableWriter(d, start_step=13, flush_every=10, unflushed_from=unflushed_from)  # resumed from step 13
        rows(w, range(14, 31))
        w.close()
        assert files(d) == files(ref), (killed_at, crash_in_flush)


def test_writer_flushes_on_a_row_budget_when_recording_every_step(tmp_path):
    # 5 rows a step (3 params + 1 summary + 1 activation); a budget of 12 rows flushes every 3rd step
    w = TableWriter(tmp_path, start_step=0, flush_every=1000, max_rows=12)
    for s in range(1, 9):
        p, su, a = fake_rows(s)
        w.add(s, params=p, summary=su, activations=a)
    parts = sorted(f.name for f in (tmp_path / "param_grads").glob("part-*.parquet"))
    assert parts == ["part-000000001-000000003.parquet", "part-000000004-000000006.parquet"]
    w.close()
    df = pd.read_parquet(tmp_path / "param_grads")
    assert sorted(df["step"]) == sorted(s for s in range(1, 9) for _ in range(3))


# --- DDP (2 gloo processes) --------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, result_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        raw, plain = make(), make()
        model = DDP(raw)
        x, y = batch(100 + rank)  # different data per rank
        prm = ParamGradRecorder(raw.named_parameters(), ["*"])
        glob_rec = ActivationGradRecorder(raw, ["middle_block", "out"], inputs=False, reduction="global")
        rank_rec = ActivationGradRecorder(raw, ["middle_block", "out"], inputs=False, reduction="per_rank")
        glob_rec.arm(0)
        rank_rec.arm(0)
        loss_fn(model, x, y).backward()
        prm.capture(0)
        param_rows, _ = prm.finish()
        glob_rows, rank_rows = glob_rec.collect(), rank_rec.collect()
        # independent: local grads on a plain copy, gathered; DDP optimises the mean of the local losses
        local = output_grads(plain, ["middle_block", "out"], [(x, y)])
        loss_fn(plain, x, y).backward()
        lp = [p.grad.clone() for p in plain.parameters()]
        gathered = {}
        for n in ("middle_block", "out"):
            parts = [torch.empty_like(local[n][0]) for _ in range(world)]
            dist.all_gather(parts, local[n][0])
            gathered[n] = parts
        for g in lp:
            dist.all_reduce(g)
            g /= world
        if rank == 0:
            for r, g in zip(param_rows, lp):
                assert r["grad_norm"] == pytest.approx(g.norm().item(), rel=1e-5), r["name"]
            for r in glob_rows:
                assert r["world_size"] == world and r["rank"] == -1 and r["calls"] == world
                check_row(r, ref_stats([g / world for g in gathered[r["module"]]]))
            assert len(rank_rows) == 2 * world
            for r in rank_rows:
                assert r["reduction"] == "per_rank"
                check_row(r, ref_stats([gathered[r["module"]][r["rank"]] / world]))
            open(os.path.join(result_dir, "ok"), "w").close()
        glob_rec.close()
        rank_rec.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok").exists()
