"""`train.cuda_graphs` (training/cuda_graphs.py): the graphed microbatch against the eager loop.

On a CPU nothing is captured, but everything around the capture runs: the static input buffers,
the outputs overwritten at every call as a replay's are, the warm-up passes (their gradients and
RNG draws undone), the flat gradient buffer and its all-reduce in place of DDP, recorded steps run
eagerly between graphed ones. So the CPU tests hold the training to the eager run's bits, and a
dispatch-level guard checks that the captured function does no host work a graph could not
replay. The `gpu` tests check the capture itself on a card (benchmarks/on_gpu.sh, cuda-tests).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from ddpmrepro import params as P
from ddpmrepro.data import prepare
from ddpmrepro.files import load_weights
from ddpmrepro.training import cuda_graphs
from ddpmrepro.training import loop as T
from ddpmrepro.training.batches import Microbatch

BASE = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16, "dropout": 0.2},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 8, "batch_per_proc": 8, "grad_accum": 2, "warmup_steps": 2, "checkpoint_every": 4,
              "log_every": 2, "timestep_sampler": "loss-second-moment", "ema_rates": [0.9],
              "posthoc_ema_snapshots": 2},
    # steps 1, 3, 6 and 8 recorded (eager); the others graphed, so the two paths alternate
    "introspect": {"every": 3, "steps": [1], "noise_buckets": 2},
    "sample": {"respacing": "ddim5"},
}
# Every input and output the captured function has: an upsampler's low-res input and its augmentation
# level, EDM2's learned weighting (its own parameters and gradients), the learned variance's VB term.
OTHER = {"diffusion": {"variance": "learned_range", "loss": "hybrid", "loss_weighting": "learned"},
         "superres": {"low_res": 4, "noise_aug": 0.2}, "train": {"precision": "bf16", "grad_accum": 1}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(P.DataParams(), out)
    return out


def params(**sections) -> P.Params:
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return P.from_dict(raw)


def train(root: Path, prepared: Path, p: P.Params) -> Path:
    T.train(p, T.TrainPaths(prepared, root / "m", root / "l", root / "i", root / "c"))
    return root


def outputs(run: Path) -> dict[str, bytes]:
    """Everything the run learned and measured, as bytes: the tensors of the weights, EMAs and
    post-hoc snapshots, the gradient tables, the loss curve (the files' metadata name the run hash,
    of which cuda_graphs is part)."""
    files = {f.relative_to(run / "m").as_posix(): b"".join(t.numpy().tobytes() for _, t in sorted(load_weights(f).items()))
             for f in sorted((run / "m").rglob("*.safetensors"))}
    for table in ("param_grads", "act_grads", "steps", "noise_levels"):
        frame = pd.read_parquet(run / "i" / table)
        files[table] = frame.sort_values(list(frame.columns[:3])).to_csv(index=False).encode()
    files["loss"] = (run / "l" / "plots" / "metrics" / "loss.tsv").read_bytes()
    return files


# an unconditional model: the network is called without labels (model_fn passes y=None)
UNCONDITIONAL = {"model": {"class_cond": False}, "train": {"label_dropout": 0.0}}


@pytest.mark.parametrize("config", ["base", "other", "unconditional"])
def test_the_graphed_step_gives_the_eager_runs_bits(tmp_path, prepared, config, one_thread):
    extra = {"base": {}, "other": OTHER, "unconditional": UNCONDITIONAL}[config]
    eager = train(tmp_path / "eager", prepared, params(**extra))
    graphed_params = params(**{**extra, "train": {**extra.get("train", {}), "cuda_graphs": True}})
    graphed = train(tmp_path / "graphed", prepared, graphed_params)
    a, b = outputs(eager), outputs(graphed)
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k] != b[k]]
    assert not different, f"not bitwise the eager run's: {different}"
    weights = load_weights(graphed / "m" / "model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in weights.items() if k.startswith("out."))  # it did train
    if config == "base":  # the noise scale from the graphed microbatches' sums, on every step
        assert pd.read_parquet(graphed / "i" / "steps")["gns_trace"].notna().all()


class HostWork(TorchDispatchMode):
    """Records the aten ops that a CUDA graph cannot hold: reading a value on the host (.item(),
    bool(), data-dependent shapes) and tensors made from host data (a copy to the card per call)."""

    FORBIDDEN = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "masked_scatter", "equal",
                 "lift_fresh", "lift_fresh_copy", "_unique2", "unique_dim", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.FORBIDDEN:
            self.seen.append(func.__name__)
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            self.seen.append("index with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config", ["base", "other"])
def test_the_captured_function_does_no_host_work(tmp_path, prepared, config, monkeypatch, one_thread):
    calls, seen = [], []
    original = cuda_graphs.MicrobatchGraph.__init__

    def guarded_init(self, forward_backward, *args, **kwargs):
        def guarded(mb):
            if mb is self.static_in:  # the graphed path (warm-up and "replays"), not the eager recorded steps
                with HostWork() as mode:
                    out = forward_backward(mb)
                calls.append(mb)
                seen.extend(mode.seen)
                return out
            return forward_backward(mb)
        original(self, guarded, *args, **kwargs)

    monkeypatch.setattr(cuda_graphs.MicrobatchGraph, "__init__", guarded_init)
    extra = {} if config == "base" else OTHER
    train(tmp_path, prepared, params(**{**extra, "train": {**extra.get("train", {}), "cuda_graphs": True}}))
    grad_accum = params(**extra).train.grad_accum
    assert len(calls) == cuda_graphs.WARMUP_PASSES + 4 * grad_accum  # the warm-up, then 4 unrecorded steps
    assert not seen, f"host work inside the captured function: {sorted(set(seen))}"


def test_the_guard_sees_host_work():
    with HostWork() as mode:
        x = torch.randn(4)
        float(x.sum())
        x[x > 0].sum()
        torch.tensor([1.0, 2.0])
    assert {"_local_scalar_dense.default", "index with a boolean mask", "lift_fresh.default"} <= set(mode.seen)


def test_outputs_are_static_and_warm_up_leaves_gradients_and_rng_as_they_were():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)

    def forward_backward(mb):
        out = torch.nn.functional.dropout(layer(mb.x0), 0.5)  # draws from the RNG
        loss = (out ** 2).mean(1) * mb.weights
        loss.mean().backward()
        return {"loss": loss}

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        return Microbatch(rows=None, flip=None, y=torch.zeros(4, dtype=torch.long), t=torch.zeros(4, dtype=torch.long),
                          weights=torch.rand(4, generator=g), noise=torch.zeros(4), cond={},
                          x0=torch.randn(4, 3, generator=g))

    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    graph = cuda_graphs.MicrobatchGraph(forward_backward, layer, opt, enabled=True, device=torch.device("cpu"))
    rng = torch.get_rng_state()
    first = graph(batch(1), eager=False)
    grad = layer.weight.grad.clone()
    # the warm-up's gradients and draws were undone: one eager pass from the same RNG state gives
    # the same loss and the same gradient
    layer.zero_grad(set_to_none=False)
    torch.set_rng_state(rng)
    expected = forward_backward(batch(1))["loss"].detach()
    assert torch.equal(first["loss"], expected) and torch.equal(layer.weight.grad, grad)
    saved = first["loss"].clone()
    second = graph(batch(2), eager=False)
    assert second["loss"] is first["loss"] and not torch.equal(first["loss"], saved)  # overwritten, as a replay
    # the gradients live in one flat buffer, and stay there when zeroed
    assert layer.weight.grad.data_ptr() == graph.grads.flat.data_ptr()
    layer.zero_grad(set_to_none=False)
    assert layer.weight.grad.data_ptr() == graph.grads.flat.data_ptr() and not graph.grads.flat.any()


def test_unsupported_combinations_are_refused_before_anything_runs():
    with pytest.raises(P.ParamsError, match="train.cuda_graphs: not with timestep_sampler 'output-grad-norm'"):
        params(train={"cuda_graphs": True, "timestep_sampler": "output-grad-norm"})
    with pytest.raises(P.ParamsError, match="train.cuda_graphs: not with model.grad_checkpoint"):
        params(train={"cuda_graphs": True}, model={"grad_checkpoint": True})


def test_the_option_is_in_the_run_hash_only_when_on():
    off, on = params(), params(train={"cuda_graphs": True})
    assert T.run_hash(off, "d") != T.run_hash(on, "d")
    # a run from before the option keeps its hash: the key is absent when off
    raw = yaml.safe_load(yaml.safe_dump(off.to_dict()))
    del raw["train"]["cuda_graphs"]
    assert T.run_hash(P.from_dict(raw), "d") == T.run_hash(off, "d")


# --- on a card ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_captured_run_trains_as_the_eager_run_does(tmp_path, prepared, precision):
    """The capture on a card, with dropout, gradient accumulation, the noise scale and recorded steps
    between graphed ones: the logged loss and gradient norm of every window are the eager run's
    (to 2%: a replay runs eager's kernels, so they should be equal; the weights' agreement is printed,
    bitwise or not, since Adam turns the rounding noise of a gradient that is zero in exact arithmetic
    into full steps)."""
    cfg = {"train": {"device": "cuda", "precision": precision}}
    eager = train(tmp_path / "eager", prepared, params(**cfg))
    graphed = train(tmp_path / "graphed", prepared, params(train={**cfg["train"], "cuda_graphs": True}))
    a, b = (load_weights(run / "m" / "model.safetensors") for run in (eager, graphed))
    diff = torch.stack([(a[k].float() - b[k].float()).norm() for k in a]).norm()
    total = torch.stack([a[k].float().norm() for k in a]).norm()
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    print(f"{precision}: graphed weights against eager: {'bitwise' if bitwise else f'{float(diff / total):.3g} relative'}")
    assert_windows_agree(eager, graphed, precision)
    assert all(torch.isfinite(v).all() for v in b.values())


def assert_windows_agree(eager: Path, graphed: Path, label: str) -> None:
    """The logged loss and gradient norm of every window (steps 2, 4, 6, 8) within 2%, printed."""
    for series in ("loss", "grad_norm"):
        x, y = (pd.read_csv(run / "l" / "plots" / "metrics" / f"{series}.tsv", sep="\t") for run in (eager, graphed))
        assert x["step"].tolist() == y["step"].tolist() == [2, 4, 6, 8]
        rel = ((x[series] - y[series]).abs() / x[series].abs()).max()
        print(f"{label}: {series} per window, graphed against eager, largest relative difference {rel:.3g}")
        assert rel < 2e-2, (series, x[series].tolist(), y[series].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_a_step_that_logs_and_saves_nothing_never_waits_for_the_gpu(tmp_path, prepared, monkeypatch, graphs):
    """Issue 38, item 1: between log and checkpoint steps the host never waits for the card, eager
    or graphed. Steps 4-7 of 8 run under CUDA's sync debug mode set to "error" (switched at the
    loop's per-step `_agree`, after the EMA update): any sync there (`.item()`, a copy to the host
    that is not pinned and non-blocking, a synchronize) raises. bf16 (fp16's scaler reads its
    scale on the host every step), no introspection, no post-hoc snapshots (files are written
    from the host), one log line and one checkpoint, at the end."""
    steps = []

    def agree(flag):
        steps.append(len(steps) + 1)
        torch.cuda.set_sync_debug_mode("error" if 3 <= steps[-1] < 7 else "default")
        return flag

    monkeypatch.setattr(T, "_agree", agree)
    p = params(train={"device": "cuda", "precision": "bf16", "cuda_graphs": graphs, "grad_accum": 1,
                      "log_every": 8, "checkpoint_every": 8, "posthoc_ema": []},
               introspect={"every": 0, "steps": [], "noise_buckets": 0})
    try:
        train(tmp_path, prepared, p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps == list(range(1, 9))
