"""`train.compile: blocks` and `sample.compile: blocks` (runtime/compilation.py) against the eager
code they replace:

- compiled training agrees with eager training within float tolerance with every instrument on
  (activation-gradient hooks, noise-level buckets' extra backward passes, the noise scale's hooks,
  dropout), records each gradient once, and Dynamo really compiled the blocks (no silent eager
  fallback);
- gradient checkpointing on a compiled run changes no bit; fp16 autocast with the GradScaler agrees
  with eager fp16;
- a compiled run killed and resumed in a new process equals the compiled run uninterrupted, bitwise,
  and Inductor's cache lands beside the checkpoints; 2 compiled processes equal 1 with the double batch;
- compiled sampling (DDIM, DPM-Solver++) equals eager sampling within tolerance, on randomised weights;
- no C++ compiler: `train` and `sample` stop with one line naming the key and how to turn it off,
  and write nothing, not even Inductor's empty cache folder.

Compilation costs about a minute on CPU for the first model of a process; the tests share shapes
and one Inductor cache directory, so later ones mostly reuse its work.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from ddpmrepro import params as P
from ddpmrepro.files import load_weights
from ddpmrepro.model.unet import AttentionBlock, ResBlock, build_unet
from ddpmrepro.runtime import compilation
from ddpmrepro.training import loop as T
from test_train import (SMALL, assert_same, env, final_state, kill_after_checkpoint, prepared,  # noqa: F401
                        run_train, train_cmd, write_params)

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One Inductor cache for the module's processes (this one's first compile fixes its own)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
    yield Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    if before is None:  # later modules' subprocesses choose their own (tests/test_pipeline.py checks where)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def in_process(tmp_path: Path, prepared: Path, name: str, **sections) -> Path:
    raw = {k: dict(v) for k, v in SMALL.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    run = tmp_path / name
    T.train(P.from_dict(raw), T.TrainPaths(prepared, run / "model", run / "live", run / "introspect", run / "ckpt"))
    return run


def table(run: Path, name: str) -> pd.DataFrame:
    df = pd.read_parquet(run / "introspect" / name)
    keys = [c for c in ("step", "name", "module", "tensor", "bucket") if c in df.columns]
    return df.sort_values(keys).reset_index(drop=True)


# Every instrument on: activation hooks every step, 2 noise-level buckets (extra backward passes
# through the compiled graph), the noise scale's parameter hooks (grad_accum 2), dropout.
INSTRUMENTS = dict(model={"dropout": 0.2}, train={"steps": 4, "grad_accum": 2, "batch_per_proc": 8},
                   introspect={"every": 1, "noise_buckets": 2})


@pytest.mark.slow
def test_compiled_training_agrees_with_eager_with_every_instrument_on(tmp_path, prepared, inductor_cache):
    from torch._dynamo.utils import counters

    counters.clear()
    eager = in_process(tmp_path, prepared, "eager", **INSTRUMENTS)
    compiled = in_process(tmp_path, prepared, "compiled", **{**INSTRUMENTS, "train": {**INSTRUMENTS["train"],
                                                                                      "compile": "blocks"}})
    # Dynamo compiled graphs, without a break (a break would run part of a block eagerly, slowly).
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    # The first update's gradients (the same weights, data, masks): float rounding apart, equal.
    ga, gb = table(eager, "param_grads"), table(compiled, "param_grads")
    assert ga[["step", "name"]].equals(gb[["step", "name"]])
    first = (ga["step"] == 1) & (ga["grad_norm"] > 1e-6)
    assert ((ga["grad_norm"] - gb["grad_norm"]).abs() / ga["grad_norm"])[first].max() < 1e-4
    # Each activation gradient recorded once per step, as in eager mode, with the same values.
    aa, ab = table(eager, "act_grads"), table(compiled, "act_grads")
    keys = ["step", "module", "tensor", "calls", "numel"]  # calls: hook firings per step (2 microbatches)
    assert aa[keys].equals(ab[keys]) and set(aa["calls"]) == {2}
    step1 = (aa["step"] == 1) & (aa["l2"] > 1e-6)
    assert ((aa["l2"] - ab["l2"]).abs() / aa["l2"])[step1].max() < 1e-4
    levels_a, levels_b = table(eager, "noise_levels"), table(compiled, "noise_levels")
    assert len(levels_a) == len(levels_b) > 0
    # Four Adam steps amplify rounding a little (as 2 processes against 1 do): float tolerance.
    wa, wb = load_weights(eager / "model" / "model.safetensors"), load_weights(compiled / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=5e-4), k
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # compiled kernels did run (they round differently)


@pytest.mark.slow
def test_grad_checkpointing_changes_no_bit_of_a_compiled_run(tmp_path, prepared, inductor_cache):
    on = {**INSTRUMENTS["train"], "compile": "blocks"}
    plain = in_process(tmp_path, prepared, "plain", **{**INSTRUMENTS, "train": on})
    ckpt = in_process(tmp_path, prepared, "ckpt", **{**INSTRUMENTS, "train": on,
                                                     "model": {"dropout": 0.2, "grad_checkpoint": True}})
    for f in ("model.safetensors", "ema_0.9.safetensors", "ema_0.99.safetensors"):
        assert (plain / "model" / f).read_bytes() == (ckpt / "model" / f).read_bytes(), f
    pd.testing.assert_frame_equal(table(plain, "act_grads"), table(ckpt, "act_grads"), check_exact=True)


@pytest.mark.slow
def test_cuda_graphs_change_no_bit_of_a_compiled_run(tmp_path, prepared, inductor_cache):
    # train.cuda_graphs on a CPU: no capture, but the compiled blocks run on the static buffers, the
    # warm-up passes (Dynamo's guards and Inductor's kernels met first there) and the flat gradients
    # Step 1 recorded (eager), steps 2-4 graphed.
    on = {**INSTRUMENTS["train"], "compile": "blocks"}
    sections = {**INSTRUMENTS, "introspect": {"every": 0, "steps": [1], "noise_buckets": 2}}
    plain = in_process(tmp_path, prepared, "plain", **{**sections, "train": on})
    graphed = in_process(tmp_path, prepared, "graphed", **{**sections, "train": {**on, "cuda_graphs": True}})
    for f in ("model.safetensors", "ema_0.9.safetensors", "ema_0.99.safetensors"):
        assert (plain / "model" / f).read_bytes() == (graphed / "model" / f).read_bytes(), f
    pd.testing.assert_frame_equal(table(plain, "act_grads"), table(graphed, "act_grads"), check_exact=True)
    loss = [pd.read_csv(run / "live" / "plots" / "metrics" / "loss.tsv", sep="\t") for run in (plain, graphed)]
    pd.testing.assert_frame_equal(*loss, check_exact=True)


@pytest.mark.slow
def test_compiled_fp16_with_the_grad_scaler_agrees_with_eager_fp16(tmp_path, prepared, inductor_cache):
    train = {"steps": 3, "precision": "fp16"}
    eager = in_process(tmp_path, prepared, "eager", train=train)
    compiled = in_process(tmp_path, prepared, "compiled", train={**train, "compile": "blocks"})
    ga, gb = table(eager, "param_grads"), table(compiled, "param_grads")
    first = (ga["step"] == ga["step"].min()) & (ga["grad_norm"] > 1e-4)
    # fp16 activations: rounding at 1e-3 relative, and the loss scale (2**16) is the same in both
    assert ((ga["grad_norm"] - gb["grad_norm"]).abs() / ga["grad_norm"])[first].median() < 1e-2
    sa, sb = table(eager, "steps"), table(compiled, "steps")
    assert sa["loss_scale"].tolist() == sb["loss_scale"].tolist()
    wa, wb = load_weights(eager / "model" / "model.safetensors"), load_weights(compiled / "model" / "model.safetensors")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-2, atol=5e-3), k


def cli_env(cache: Path) -> dict:
    return {**env(), "TORCHINDUCTOR_CACHE_DIR": str(cache)}


@pytest.mark.slow
def test_a_compiled_run_killed_and_resumed_equals_it_uninterrupted_bitwise(tmp_path, prepared, inductor_cache):
    params = write_params(tmp_path / "p.yaml", train={"compile": "blocks"})
    straight = tmp_path / "straight"
    # The default cache location, once: beside the checkpoints (git- and DVC-ignored).
    proc = subprocess.run(train_cmd(straight, prepared, params, 1), capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in env().items() if k != "TORCHINDUCTOR_CACHE_DIR"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any((straight / "ckpt" / "inductor-cache").rglob("*.so")), "no compiled kernel in the run's cache"
    resumed = tmp_path / "resumed"
    kill_after_checkpoint(resumed, prepared, params, 1, step=4)
    run_train(resumed, prepared, params, 1)
    assert_same(final_state(straight), final_state(resumed), exact=True)
    for t in ("param_grads", "act_grads"):
        pd.testing.assert_frame_equal(table(straight, t), table(resumed, t), check_exact=True)


@pytest.mark.slow
def test_two_compiled_processes_equal_one_with_the_double_batch(tmp_path, prepared, inductor_cache):
    runs = {}
    for nproc in (1, 2):
        params = write_params(tmp_path / f"p{nproc}.yaml", train={"compile": "blocks", "nproc": nproc,
                                                                  "batch_per_proc": 16 // nproc, "steps": 4},
                              introspect={"every": 1})
        runs[nproc] = tmp_path / f"n{nproc}"
        proc = subprocess.run(train_cmd(runs[nproc], prepared, params, nproc), capture_output=True, text=True,
                              timeout=900, env=cli_env(inductor_cache))
        assert proc.returncode == 0, proc.stderr[-3000:]
    ga, gb = table(runs[1], "param_grads"), table(runs[2], "param_grads")
    first = (ga["step"] == 1) & (ga["grad_norm"] > 1e-6)
    assert ((ga["grad_norm"] - gb["grad_norm"]).abs() / ga["grad_norm"])[first].max() < 1e-4
    wa, wb = load_weights(runs[1] / "model" / "model.safetensors"), load_weights(runs[2] / "model" / "model.safetensors")
    near = [torch.allclose(wa[k], wb[k], rtol=1e-3, atol=5e-4) for k in wa]
    # as in test_train's eager version, a bias whose gradient a GroupNorm removes is rounding noise
    # that Adam turns into full steps: allow those few
    assert sum(near) >= 0.95 * len(near)


def randomised_unet() -> torch.nn.Module:
    """The SMALL UNet with every weight random (zero-initialised output convs would make any
    compiled network 'agree': it outputs 0)."""
    model = build_unet(P.ModelParams(**{**SMALL["model"], "dropout": 0.0}), image_size=8, in_channels=1,
                       num_classes=10, learn_sigma=False).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.2)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["ddim", "dpmpp_2m"])
def test_compiled_sampling_agrees_with_eager(sampler, inductor_cache):
    from ddpmrepro.evaluation.sample import generate, process

    p = P.SampleParams(sampler=sampler, respacing="ddim5", nfe=5, spacing="time_uniform", guidance=0.5)
    diffusion, _ = process(P.DiffusionParams(timesteps=10), p, Path("model"))
    labels = torch.arange(10)
    seeds = list(range(10))
    eager_model, compiled_model = randomised_unet(), randomised_unet()
    assert compilation.compile_blocks(compiled_model)
    with torch.no_grad():
        outs = {}
        for name, model in (("eager", eager_model), ("compiled", compiled_model)):
            outs[name] = generate(model, diffusion, labels, seeds, p, 10, (1, 8, 8), torch.device("cpu"))
    a, b = outs["eager"].float(), outs["compiled"].float()
    assert a.std() > 10  # random weights make varied images, not a constant
    # uint8 images: a pixel may round the other way
    assert (a - b).abs().max() <= 1 and (a != b).float().mean() < 0.01


def test_blocks_with_a_hooked_module_inside_stay_eager():
    model = randomised_unet()
    blocks = [n for n, m in model.named_modules() if isinstance(m, (ResBlock, AttentionBlock))]
    inside = f"{blocks[0]}.in_layers"
    compiled = compilation.compile_blocks(model, eager_inside={inside, "input_blocks.0", "out"})
    assert set(compiled) == set(blocks) - {blocks[0]}  # hooks on containers and on other blocks keep theirs
    assert [n for n, m in model.named_modules() if "forward" in vars(m)] == compiled  # only those were touched
    assert compilation.compile_blocks(model, eager_inside={inside}) == compiled  # idempotent
    # parameter names, and so checkpoints, EMAs and the gradient tables, are the eager model's
    assert list(dict(model.named_parameters())) == list(dict(randomised_unet().named_parameters()))


def snapshot(root: Path) -> dict:
    return {f.relative_to(root).as_posix(): f.read_bytes() if f.is_file() else None for f in sorted(root.rglob("*"))}


@pytest.mark.parametrize("stage", ["train", "sample"])
def test_without_a_cxx_compiler_compile_is_one_line_and_nothing_is_written(tmp_path, prepared, stage):
    """As a user would meet it: the CLI in a project folder, $TORCHINDUCTOR_CACHE_DIR unset (so the
    cache would go to CHECKPOINTS/inductor-cache, or ./checkpoints/inductor-cache for sample), and
    not even an empty cache folder is left behind (importing Dynamo for the check creates one)."""
    params = write_params(tmp_path / "p.yaml", **{stage: {"compile": "blocks"}})
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "SHA256SUMS"):  # what a finished model directory holds
        (model / name).write_bytes(b"a finished model")
    if stage == "train":
        cmd = train_cmd(tmp_path / "run", prepared, params, 1)
    else:
        cmd = [*train_cmd(tmp_path / "run", prepared, params, 1)[:3], "sample", "--params", str(params),
               "--model", str(model), "--out", str(tmp_path / "samples"), "--nproc", "1"]
    environ = {k: v for k, v in env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    before = snapshot(tmp_path)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**environ, "CXX": str(tmp_path / "no-such-compiler")})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {stage}.compile: 'blocks' needs a C++ compiler"), \
        proc.stderr
    assert "no-such-compiler" in lines[0] and f"set {stage}.compile: none" in lines[0]
    assert snapshot(tmp_path) == before  # no run/ckpt/inductor-cache, no ./checkpoints/inductor-cache
