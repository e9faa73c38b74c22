"""Sampling is a function of (model, params, image index): not of batch size or process count."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from click.testing import CliRunner

from ddpmrepro import params as P
from ddpmrepro.cli import main
from ddpmrepro.data import prepare

SRC = Path(__file__).resolve().parents[1] / "src"
SMALL = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16},
    "diffusion": {"timesteps": 20},
    "train": {"steps": 3, "batch_per_proc": 16, "ema_rates": [0.9]},
    "sample": {"ema_rate": 0.9, "per_class": 2, "respacing": "ddim4", "guidance": 0.5},
}


def cli(*args, cwd: Path):
    proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sample")
    prepare(P.DataParams(), root / "data")
    (root / "params.yaml").write_text(yaml.safe_dump(SMALL))
    cli("train", "--data", "data", "--out", "model", "--live", "live", "--introspect", "intro",
        "--checkpoints", "ckpt", cwd=root)
    return root


def write_params(root: Path, name: str, **sample) -> str:
    raw = {k: dict(v) for k, v in SMALL.items()}
    raw["sample"].update(sample)
    (root / name).write_text(yaml.safe_dump(raw))
    return name


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["ddim", "ddpm"])
def test_images_do_not_depend_on_batch_size_or_process_count(trained, sampler):
    extra = {"sampler": sampler, "eta": 0.5} if sampler == "ddim" else {"sampler": sampler, "respacing": "10"}
    a = write_params(trained, f"a_{sampler}.yaml", batch_size=8, **extra)
    b = write_params(trained, f"b_{sampler}.yaml", batch_size=3, nproc=2, **extra)
    cli("sample", "--params", a, "--model", "model", "--out", f"s_a_{sampler}", cwd=trained)
    cli("sample", "--params", b, "--model", "model", "--out", f"s_b_{sampler}", cwd=trained)
    za, zb = (np.load(trained / f"s_{x}_{sampler}" / "samples.npz") for x in "ab")
    assert za["images"].shape == (20, 1, 8, 8) and za["images"].dtype == np.uint8
    assert np.array_equal(za["labels"], np.repeat(np.arange(10), 2))
    assert np.array_equal(za["seeds"], zb["seeds"]) and np.array_equal(za["labels"], zb["labels"])
    # the same images, up to the last bit of float rounding in batched convolutions
    diff = np.abs(za["images"].astype(int) - zb["images"].astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    assert (trained / f"s_a_{sampler}" / "grid.png").stat().st_size > 0
    # so the record beside them leaves both keys out: the same images are the same directory for DVC
    record = {x: (trained / f"s_{x}_{sampler}" / "params.yaml").read_bytes() for x in "ab"}
    assert record["a"] == record["b"] and b"batch_size" not in record["a"] and b"nproc" not in record["a"]
    assert yaml.safe_load(record["a"])["sample"]["sampler"] == sampler


@pytest.mark.slow
def test_a_different_seed_gives_different_images(trained):
    a = write_params(trained, "s0.yaml", seed=0)
    b = write_params(trained, "s1.yaml", seed=1)
    cli("sample", "--params", a, "--model", "model", "--out", "seed0", cwd=trained)
    cli("sample", "--params", b, "--model", "model", "--out", "seed1", cwd=trained)
    assert not np.array_equal(np.load(trained / "seed0/samples.npz")["images"],
                              np.load(trained / "seed1/samples.npz")["images"])


def test_a_respacing_the_trained_model_cannot_take_names_the_key_and_the_models_t(trained):
    # params.yaml says 1000 timesteps (ddim50 is fine there) but the model was trained with 20.
    raw = {k: dict(v) for k, v in SMALL.items()}
    raw["diffusion"]["timesteps"], raw["sample"]["respacing"] = 1000, "ddim50"
    (trained / "t1000.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "sample", "--params", "t1000.yaml", "--model",
                           "model", "--out", "never"], cwd=trained, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "Error: sample.respacing: 'ddim50': no integer stride takes exactly 50 of 20 steps (range(0, 20, i) for "
        "some i < 20); nearest possible: 'ddim20' (the model in model has 20 timesteps)"]
    assert not (trained / "never").exists()


@pytest.mark.parametrize("sampler,extra", [("dpmpp_2m", {}), ("dpmpp_2m_sde", {"nfe": 6}),
                                           ("unipc", {"spacing": "time_uniform", "thresholding": "dynamic"}),
                                           ("heun", {"spacing": "karras", "nfe": 7, "churn": 1.0})])
def test_the_fast_samplers_run_through_the_cli_and_record_their_network_calls(trained, sampler, extra):
    # in-process (CliRunner): the same command without a second torch import per sampler
    name = write_params(trained, f"fast_{sampler}.yaml", sampler=sampler, batch_size=7, **extra)
    result = CliRunner().invoke(main, ["sample", "--params", str(trained / name), "--model", str(trained / "model"),
                                       "--out", str(trained / f"fast_{sampler}")])
    assert result.exit_code == 0, result.output
    z = np.load(trained / f"fast_{sampler}" / "samples.npz")
    assert z["images"].shape == (20, 1, 8, 8) and z["images"].std() > 0
    sampling = json.loads((trained / f"fast_{sampler}" / "sampling.json").read_text())
    assert sampling == {"sampler": sampler, "nfe": extra.get("nfe", 20), "guidance": 0.5}


@pytest.mark.parametrize("sampler,extra", [("ddim", {"eta": 0.5}), ("ddpm", {"respacing": "10"}),
                                           ("dpmpp_2m", {}), ("unipc", {}), ("heun", {"nfe": 7, "churn": 1.0})])
def test_graphed_sampling_gives_the_eager_images_bit_for_bit(trained, sampler, extra):
    """sample.cuda_graphs on a CPU: nothing is captured, but the static buffers, one per batch shape
    (7, 7 and 6 images: two shapes), and the output overwritten at every call as a replay's, run as
    on a card, for every sampler."""
    images = {}
    for graphs in (False, True):
        name = write_params(trained, f"graphs_{sampler}_{graphs}.yaml", sampler=sampler, batch_size=7,
                            cuda_graphs=graphs, **extra)
        out = trained / f"graphs_{sampler}_{graphs}"
        result = CliRunner().invoke(main, ["sample", "--params", str(trained / name), "--model",
                                           str(trained / "model"), "--out", str(out)])
        assert result.exit_code == 0, result.output
        images[graphs] = np.load(out / "samples.npz")["images"]
    assert images[True].std() > 0 and np.array_equal(images[True], images[False])


def test_a_graphed_network_keeps_one_graph_per_input_shape_and_hands_out_copies():
    import torch

    from ddpmrepro.runtime.graphed_network import GraphedNetwork

    net = torch.nn.Conv2d(1, 1, 3, padding=1)
    graphed = GraphedNetwork(net, torch.device("cpu"))
    assert graphed.weight is net.weight  # the network's attributes, as the samplers and bind_labels read them
    with torch.no_grad():
        a, b, c = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4), torch.randn(3, 1, 4, 4)
        out_a = graphed(a)
        out_b = graphed(b)
        out_c = graphed(c)
        # each call's output is its own: a caller keeping one (a solver's history) sees it whole
        assert torch.equal(out_a, net(a)) and torch.equal(out_b, net(b)) and torch.equal(out_c, net(c))
    assert len(graphed.entries) == 2  # (2, 1, 4, 4) and (3, 1, 4, 4)


def test_fp16_on_a_cpu_is_named_as_slow_there_once_and_nothing_else_is(caplog):
    """A GPU preset's fp16 on a laptop: one line that it has no fast path there (found from outside:
    a training ran at 60 s a step without a word)."""
    import logging

    from ddpmrepro.runtime.autocast_network import note_slow_here

    with caplog.at_level(logging.INFO, logger="ddpmrepro.runtime.autocast_network"):
        for precision, device in (("fp32", "cpu"), ("bf16", "cpu"), ("fp16", "cuda"), ("fp16", "cpu")):
            note_slow_here(precision, device, "train.precision")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["train.precision"]
    assert "fp16 on a CPU" in caplog.records[0].getMessage()


def test_an_autocast_network_computes_in_its_dtype_and_hands_out_float32():
    """What bf16 and fp16 mean for a linear layer, written out: inputs, weights and bias rounded to
    the dtype, the product in it; the output back as float32 for the solver."""
    import torch

    from ddpmrepro.runtime.autocast_network import AutocastNetwork, with_precision

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    for dtype in (torch.bfloat16, torch.float16):
        wrapped = AutocastNetwork(net, dtype, torch.device("cpu"))
        assert wrapped.weight is net.weight  # the network's attributes, as bind_labels and the samplers read them
        with torch.no_grad():
            out = wrapped(x)
            by_hand = torch.nn.functional.linear(x.to(dtype), net.weight.to(dtype), net.bias.to(dtype)).float()
            assert out.dtype == torch.float32 and torch.equal(out, by_hand)
            assert not torch.equal(out, net(x))  # it did round
    assert with_precision(net, "fp32", "cpu") is net  # fp32 is the network itself: a default run's images unchanged
    assert isinstance(with_precision(net, "bf16", "cpu"), AutocastNetwork)


def test_bf16_and_fp16_sampling_move_the_images_by_the_networks_rounding(trained):
    """sample.precision through the CLI: the images within a uint8 level of fp32's on this model (its
    digits are nearly black and white, so most pixels saturate), the option recorded with them, and
    a graphed bf16 run gives the eager bf16 images to the bit."""
    images = {}
    for precision, graphs in (("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True)):
        name = write_params(trained, f"precision_{precision}_{graphs}.yaml", sampler="dpmpp_2m", batch_size=7,
                            precision=precision, cuda_graphs=graphs)
        out = trained / f"precision_{precision}_{graphs}"
        result = CliRunner().invoke(main, ["sample", "--params", str(trained / name), "--model",
                                           str(trained / "model"), "--out", str(out)])
        assert result.exit_code == 0, result.output
        images[precision, graphs] = np.load(out / "samples.npz")["images"].astype(int)
        assert yaml.safe_load((out / "params.yaml").read_text())["sample"]["precision"] == precision
    fp32 = images["fp32", False]
    for key, got in images.items():
        diff = np.abs(got - fp32)
        print(f"{key}: mean uint8 difference from fp32 {diff.mean():.4f}, max {diff.max()}")
        assert diff.max() <= 1 and got.std() > 0
    assert np.array_equal(images["bf16", True], images["bf16", False])


@pytest.mark.gpu
def test_bf16_sampling_on_a_card_stays_close_to_fp32():
    """The network in bf16 on a card, every weight random: the images move, but little; printed."""
    import torch

    from ddpmrepro.evaluation.sample import generate
    from ddpmrepro.model.diffusion import from_params
    from ddpmrepro.model.unet import build_unet
    from ddpmrepro.runtime.autocast_network import with_precision

    torch.manual_seed(0)
    net = build_unet(P.ModelParams(**SMALL["model"]), image_size=8, in_channels=1, num_classes=10).cuda().eval()
    for p in net.parameters():
        p.data.normal_(0, 0.05)
    p = P.SampleParams(sampler="ddim", respacing="ddim10", guidance=0.5)
    diffusion = from_params(P.DiffusionParams(timesteps=100), respacing=p.respacing)
    labels, seeds = torch.arange(10) % 10, list(range(10))
    fp32 = generate(net, diffusion, labels, seeds, p, 10, (1, 8, 8), "cuda").float()
    bf16 = generate(with_precision(net, "bf16", "cuda"), diffusion, labels, seeds, p, 10, (1, 8, 8), "cuda").float()
    diff = (fp32 - bf16).abs()
    corr = float(torch.corrcoef(torch.stack([fp32.flatten(), bf16.flatten()]))[0, 1])
    print(f"bf16 DDIM-10 against fp32: mean uint8 difference {float(diff.mean()):.3f}, max {int(diff.max())}, "
          f"correlation {corr:.4f}")
    assert corr > 0.95 and float(diff.mean()) < 8


@pytest.mark.gpu
def test_captured_sampling_is_within_a_uint8_level_of_eager():
    import torch

    from ddpmrepro.evaluation.sample import generate
    from ddpmrepro.model.diffusion import from_params
    from ddpmrepro.model.unet import build_unet
    from ddpmrepro.runtime.graphed_network import GraphedNetwork

    torch.manual_seed(0)
    net = build_unet(P.ModelParams(**SMALL["model"]), image_size=8, in_channels=1, num_classes=10).cuda().eval()
    for p in net.parameters():  # every weight random (the output layer starts at zero)
        p.data.normal_(0, 0.05)
    p = P.SampleParams(sampler="ddim", respacing="ddim10", guidance=0.5)
    diffusion = from_params(P.DiffusionParams(timesteps=100), respacing=p.respacing)
    labels, seeds = torch.arange(10) % 10, list(range(10))
    eager = generate(net, diffusion, labels, seeds, p, 10, (1, 8, 8), "cuda")
    graphed = generate(GraphedNetwork(net, torch.device("cuda")), diffusion, labels, seeds, p, 10, (1, 8, 8), "cuda")
    diff = (eager.int() - graphed.int()).abs()
    print(f"captured DDIM-10 against eager: max uint8 difference {int(diff.max())}, identical {float((diff == 0).float().mean()):.3f}")
    assert int(diff.max()) <= 1


@pytest.mark.parametrize("bad,message", [
    ({"sampler": "dpm"}, "sample.sampler: 'dpm' is not one of ddim | ddpm | dpmpp_2m | dpmpp_2m_sde | unipc | heun"),
    ({"sampler": "unipc", "nfe": 2}, "sample.nfe: must be >= 3, got 2"),
    ({"sampler": "unipc", "spacing": "quadratic"},
     "sample.spacing: 'quadratic' is not one of logsnr | time_uniform | karras | respacing"),
    ({"sampler": "ddim", "thresholding": "dynamic"},
     "sample.thresholding: 'dynamic' is for the fast solvers; ddim takes static or none (its clip_denoised)"),
    ({"sampler": "unipc", "churn": 1.0}, "sample.churn: only heun adds churn, not unipc; set churn: 0"),
    ({"precision": "fp8"}, "sample.precision: 'fp8' is not one of fp32 | bf16 | fp16"),
])
def test_bad_sampler_values_exit_2_with_one_line_and_write_nothing(tmp_path, bad, message):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"sample": bad}))
    result = CliRunner().invoke(main, ["sample", "--params", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"Error: {path}: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]
