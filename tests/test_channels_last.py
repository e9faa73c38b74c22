"""`train.channels_last` and `sample.channels_last`: the weights and images in NHWC.

The layout is a matter of strides: the same numbers, the convolutions run by kernels that round
differently. So the tests hold a channels_last run to the contiguous run's mathematics (the first
step's gradients, before Adam amplifies rounding; the loss along the run), to its own bits where
nothing but the layout's path is involved (graphed against eager, stopped and resumed), and check
that the layout is really the one every convolution sees, so that a switch that did nothing could
not pass. Exported weights are stored in the usual layout.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from click.testing import CliRunner

from ddpmrepro import params as P
from ddpmrepro.cli import main
from ddpmrepro.files import load_weights
from ddpmrepro.training import cuda_graphs
from ddpmrepro.training import loop as T
from test_cuda_graphs import OTHER, assert_windows_agree, outputs, params, prepared, train  # noqa: F401 (a fixture)

CL = torch.channels_last


def layout(x: torch.Tensor) -> str:
    """"nhwc", "nchw", or "either" (one channel, or 1x1 spatially: both layouts at once)."""
    cl, contiguous = x.is_contiguous(memory_format=CL), x.is_contiguous()
    return "either" if cl and contiguous else "nhwc" if cl else "nchw" if contiguous else "strided"


class ConvLayouts:
    """The layouts every Conv2d call saw, recorded while it is on: {(what, in_channels): {layouts}}
    for what in ("input", "weight")."""

    def __init__(self, monkeypatch):
        self.seen: dict[tuple[str, int], set[str]] = {}
        forward = torch.nn.Conv2d.forward

        def recording(conv, x):
            for what, tensor in (("input", x), ("weight", conv.weight)):
                self.seen.setdefault((what, conv.in_channels), set()).add(layout(tensor))
            return forward(conv, x)

        monkeypatch.setattr(torch.nn.Conv2d, "forward", recording)

    def other_than(self, wanted: str) -> dict:
        """What was seen in a layout other than `wanted` (or "either")."""
        return {k: v - {wanted, "either"} for k, v in self.seen.items() if v - {wanted, "either"}}


def with_train(extra: dict, **train_values) -> P.Params:
    return params(**{**extra, "train": {**extra.get("train", {}), **train_values}})


def test_flat_gradients_are_strided_as_their_parameters():
    """train.cuda_graphs' flat buffer: each gradient a view with its parameter's strides (NHWC for a
    channels_last convolution, as autograd lays out a new gradient), its values kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 2, 1)).to(memory_format=CL)
    model(torch.randn(2, 3, 5, 5)).square().sum().backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    grads = cuda_graphs.FlatGradients(model)
    grads.adopt()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name
        assert torch.equal(p.grad, before[name]), name
        assert p.grad.untyped_storage().data_ptr() == grads.flat.untyped_storage().data_ptr()
    # each element of the buffer belongs to exactly one gradient
    grads.flat.zero_()
    for p in model.parameters():
        p.grad.add_(1)
    assert torch.equal(grads.flat, torch.ones_like(grads.flat))


@pytest.mark.parametrize("config", ["base", "other"])
def test_a_channels_last_run_computes_what_the_contiguous_run_computes(tmp_path, prepared, config, monkeypatch,
                                                                        one_thread):
    """The first step's gradients (recorded per parameter, before Adam turns rounding into steps)
    equal the contiguous run's to 1e-6 of their total; the logged loss stays within 2% along the
    run; every convolution saw NHWC weights and, but for one, NHWC inputs."""
    extra = {} if config == "base" else OTHER
    contiguous = train(tmp_path / "contiguous", prepared, with_train(extra))
    layouts = ConvLayouts(monkeypatch)
    nhwc = train(tmp_path / "nhwc", prepared, with_train(extra, channels_last=True))
    # The upsampler's first convolution (2 input channels here) is the exception: a 1-channel image
    # is NCHW and NHWC at once, and torch.cat of two of them lays out NCHW (with 3 channels, NHWC).
    # cuDNN follows the weight's layout then (one transpose).
    assert layouts.seen and layouts.other_than("nhwc") == ({} if config == "base" else {("input", 2): {"nchw"}})
    ga, gb = (pd.read_parquet(run / "i" / "param_grads").set_index(["step", "name"])["grad_norm"].sort_index()
              for run in (contiguous, nhwc))
    assert ga.index.equals(gb.index)
    first_a, first_b = ga.loc[1], gb.loc[1]
    total = float((first_a ** 2).sum() ** 0.5)
    assert float((first_a - first_b).abs().max()) <= 1e-6 * total
    for series in ("loss", "mse"):
        a, b = (pd.read_csv(run / "l" / "plots" / "metrics" / f"{series}.tsv", sep="\t")[series]
                for run in (contiguous, nhwc))
        assert ((a - b).abs() / a.abs()).max() < 2e-2, (series, a.tolist(), b.tolist())
    # the exported weights are stored in the usual layout, and load into a contiguous model as they are
    for f in sorted((nhwc / "m").rglob("*.safetensors")):
        assert all(t.is_contiguous() for t in load_weights(f).values()), f


@pytest.mark.parametrize("config", ["base", "other"])
def test_graphed_channels_last_gives_the_eager_channels_last_runs_bits(tmp_path, prepared, config, one_thread):
    """train.cuda_graphs with NHWC weights (on a CPU: its static buffers and flat strided gradients,
    recorded steps eager between graphed ones): every output the eager NHWC run's to the bit."""
    extra = {} if config == "base" else OTHER
    eager = outputs(train(tmp_path / "eager", prepared, with_train(extra, channels_last=True)))
    graphed = outputs(train(tmp_path / "graphed", prepared, with_train(extra, channels_last=True, cuda_graphs=True)))
    assert sorted(eager) == sorted(graphed)
    assert not [k for k in eager if eager[k] != graphed[k]]


def test_a_channels_last_run_stopped_and_resumed_equals_it_uninterrupted(tmp_path, prepared, monkeypatch,
                                                                           one_thread):
    """Stopped at step 4 (its checkpoint: NHWC weights, EMAs and AdamW's moments), then resumed in a
    new model: every weight, EMA, post-hoc snapshot, table and logged loss is the uninterrupted run's."""
    p = with_train({}, channels_last=True)
    straight = outputs(train(tmp_path / "straight", prepared, p))

    calls = []

    def stop_at_4(flag):
        calls.append(1)
        return len(calls) == 4

    with monkeypatch.context() as m:
        m.setattr(T, "_agree", stop_at_4)
        with pytest.raises(SystemExit):
            train(tmp_path / "resumed", prepared, p)
    assert not (tmp_path / "resumed" / "m").exists()
    resumed = outputs(train(tmp_path / "resumed", prepared, p))
    assert sorted(straight) == sorted(resumed)
    assert not [k for k in straight if straight[k] != resumed[k]]


def test_every_instrument_measures_the_same_first_step_in_nhwc(tmp_path, prepared, one_thread):
    """The activation-gradient dumps, histograms, noise-level buckets and output-grad-norm's hooks
    on NHWC tensors: the first step's dumped activation gradients are the NCHW run's to 1e-5 of their
    norm, stored in the usual layout."""
    instruments = {"introspect": {"every": 3, "steps": [1], "noise_buckets": 2, "histogram_bins": 8,
                                  "dump_steps": [1], "dump_modules": ["input_blocks.1", "middle_block", "out"]}}
    dumps = {}
    for name, nhwc in (("nchw", False), ("nhwc", True)):
        run = train(tmp_path / name, prepared, with_train(instruments, channels_last=nhwc,
                                                          timestep_sampler="output-grad-norm"))
        (dump,) = sorted((run / "i" / "dumps").glob("step-*1.safetensors"))
        dumps[name] = load_weights(dump)
    assert sorted(dumps["nchw"]) == sorted(dumps["nhwc"]) and dumps["nchw"]
    for key, a in dumps["nchw"].items():
        b = dumps["nhwc"][key]
        assert b.shape == a.shape and b.is_contiguous(), key
        assert float((a - b).norm()) <= 1e-5 * float(a.norm()), key


def test_the_option_is_in_the_run_hash_only_when_on():
    off, on = params(), params(train={"channels_last": True})
    assert T.run_hash(off, "d") != T.run_hash(on, "d")
    raw = yaml.safe_load(yaml.safe_dump(off.to_dict()))
    del raw["train"]["channels_last"]  # a run from before the option keeps its hash
    assert T.run_hash(P.from_dict(raw), "d") == T.run_hash(off, "d")


@pytest.mark.slow
def test_two_channels_last_processes_equal_one_with_the_double_batch(tmp_path, prepared):
    """DDP (eager) and the flat buffer's all-reduce (train.cuda_graphs) with NHWC gradients: the
    first step's all-reduced gradients of 2 processes x 8 equal 1 process x 16's."""
    from test_train import run_train, write_params

    runs = {}
    for name, nproc, graphs in (("one", 1, False), ("two", 2, False), ("two_graphed", 2, True)):
        path = write_params(tmp_path / f"{name}.yaml", train={"batch_per_proc": 16 // nproc, "nproc": nproc,
                                                              "steps": 2, "channels_last": True,
                                                              "cuda_graphs": graphs},
                            introspect={"steps": [1]})
        run_train(tmp_path / name, prepared, path, nproc=nproc)
        table = pd.read_parquet(tmp_path / name / "introspect" / "param_grads")
        runs[name] = table[table["step"] == 1].set_index("name")["grad_norm"].sort_index()
    total = float((runs["one"] ** 2).sum() ** 0.5)
    for name in ("two", "two_graphed"):
        assert runs[name].index.equals(runs["one"].index)
        assert float((runs[name] - runs["one"]).abs().max()) < 1e-5 * total, name


def test_channels_last_sampling_moves_no_image_by_more_than_a_level(tmp_path, prepared, monkeypatch):
    """sample.channels_last through the CLI on a model trained here: the images within one uint8
    level of the contiguous network's, the network's convolutions in NHWC, and graphed equal to eager."""
    root = tmp_path
    raw = {k: dict(v) for k, v in params().to_dict().items()}
    raw["train"].update(steps=3)
    raw["sample"].update(per_class=2, sampler="dpmpp_2m", batch_size=7, ema_rate=0.9)
    (root / "p.yaml").write_text(yaml.safe_dump(raw))
    run = CliRunner().invoke(main, ["train", "--params", str(root / "p.yaml"), "--data", str(prepared), "--out",
                                    str(root / "model"), "--live", str(root / "live"), "--introspect",
                                    str(root / "intro"), "--checkpoints", str(root / "ckpt")])
    assert run.exit_code == 0, run.output
    images = {}
    for channels_last, graphs in ((False, False), (True, False), (True, True)):
        raw["sample"].update(channels_last=channels_last, cuda_graphs=graphs)
        name = root / f"s_{channels_last}_{graphs}.yaml"
        name.write_text(yaml.safe_dump(raw))
        with monkeypatch.context() as m:
            layouts = ConvLayouts(m)
            result = CliRunner().invoke(main, ["sample", "--params", str(name), "--model", str(root / "model"),
                                               "--out", str(root / name.stem)])
        assert result.exit_code == 0, result.output
        weights = {k: v for k, v in layouts.seen.items() if k[0] == "weight"}
        assert weights and not {k: v for k, v in layouts.other_than("nhwc" if channels_last else "nchw").items()
                                if k[0] == "weight"}, weights
        if channels_last:  # the network's input stays NCHW (one channel here); every later one follows the weights
            assert {k: v for k, v in layouts.other_than("nhwc").items() if k[0] == "input"} in ({}, {("input", 1): {"nchw"}})
        images[channels_last, graphs] = np.load(root / name.stem / "samples.npz")["images"].astype(int)
    base = images[False, False]
    diff = np.abs(images[True, False] - base)
    print(f"channels_last: mean uint8 difference {diff.mean():.4f}, max {diff.max()}")
    assert base.std() > 0 and diff.max() <= 1
    assert np.array_equal(images[True, True], images[True, False])


@pytest.mark.gpu
def test_a_captured_channels_last_run_trains_as_the_eager_one_on_a_card(tmp_path, prepared, monkeypatch):
    """train.cuda_graphs with NHWC weights on a card (static NHWC buffers, the strided flat gradients
    written by the replays), bf16: the logged loss and gradient norm of every window within 2% of
    the eager NHWC run's (as tests/test_cuda_graphs.py asks of NCHW); every weight NHWC and finite.
    The layouts the convolutions saw are printed (CUDA's GroupNorm may hand them NCHW inputs)."""
    cfg = {"device": "cuda", "precision": "bf16", "channels_last": True}
    eager = train(tmp_path / "eager", prepared, params(train=cfg))
    layouts = ConvLayouts(monkeypatch)
    graphed = train(tmp_path / "graphed", prepared, params(train={**cfg, "cuda_graphs": True}))
    print(f"layouts the convolutions saw (graphed run): {layouts.seen}")
    assert not {k: v for k, v in layouts.other_than("nhwc").items() if k[0] == "weight"}
    assert_windows_agree(eager, graphed, "NHWC bf16")
    assert all(torch.isfinite(v).all() for v in load_weights(graphed / "m" / "model.safetensors").values())
