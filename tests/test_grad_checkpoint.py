"""Gradient checkpointing (`model.grad_checkpoint`) changes memory, never numbers.

Against the same network without it (the independent truth): a training step's gradients are
bitwise equal with dropout on (the recompute draws the same masks), and the activation-gradient
tables record each gradient once, with the same values, also for modules inside a recomputed block.
The multi-process invariants (exact resume, 2 processes) with it on are in tests/test_train.py.
"""
from __future__ import annotations

import pytest
import torch

from ddpmrepro import params as P
from ddpmrepro.model.diffusion import from_params as diffusion_from_params
from ddpmrepro.model.unet import build_unet
from ddpmrepro.training.introspect import ActivationGradRecorder


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one thread


def make_model(grad_checkpoint: bool, dropout: float = 0.3):
    """A two-level UNet with attention at both levels and in the middle, every weight randomised
    (the zero-initialised output convs would make most gradients vanish)."""
    torch.manual_seed(0)
    mp = P.ModelParams(preset="tiny", channels=16, channel_mult=[1, 2], num_res_blocks=1,
                       attention_resolutions=[8, 4], num_head_channels=8, dropout=dropout,
                       grad_checkpoint=grad_checkpoint)
    model = build_unet(mp, image_size=8, in_channels=1, num_classes=3, learn_sigma=True)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    return model.train()


DIFFUSION = diffusion_from_params(P.DiffusionParams(timesteps=100, variance="learned_range", loss="hybrid"))


def batch(n=6):
    g = torch.Generator().manual_seed(1)
    return (torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 4, (n,), generator=g),
            torch.randint(0, 100, (n,), generator=g), torch.randn(n, 1, 8, 8, generator=g))


def step_grads(model, seed: int = 7) -> dict[str, torch.Tensor]:
    """One training step's gradients: two microbatches (accumulation), dropout masks from `seed`."""
    torch.manual_seed(seed)
    x0, y, t, noise = batch()
    for half in (slice(0, 3), slice(3, 6)):
        losses = DIFFUSION.training_losses(lambda x, tt: model(x, tt, y[half]), x0[half], t[half], noise=noise[half])
        (losses["loss"].mean() / 2).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_training_step_has_bitwise_equal_gradients_with_and_without_checkpointing():
    plain, ckpt = make_model(False), make_model(True)
    ref = step_grads(plain)
    got = step_grads(ckpt)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # The test can fail: dropout is live (other masks give other gradients) ...
    other = step_grads(plain, seed=8)
    assert not all(torch.equal(ref[n], other[n]) for n in ref)
    # ... and a recompute that redraws the masks (improved-diffusion's own checkpoint helper does not
    # restore the RNG) would not give these gradients.
    from torch.utils import checkpoint as C

    real = C.checkpoint
    C_patched = lambda fn, *args, **kw: real(fn, *args, **{**kw, "preserve_rng_state": False})  # noqa: E731
    import ddpmrepro.model.unet as U

    U.checkpoint = C_patched
    try:
        redrawn = step_grads(ckpt)
    finally:
        U.checkpoint = real
    assert not all(torch.equal(ref[n], redrawn[n]) for n in ref)


def test_checkpointing_is_inert_without_grad_and_keeps_the_state_dict():
    plain, ckpt = make_model(False), make_model(True)
    assert plain.state_dict().keys() == ckpt.state_dict().keys()
    x0, y, t, _ = batch()
    plain.eval(), ckpt.eval()
    with torch.no_grad():
        assert torch.equal(plain(x0, t, y), ckpt(x0, t, y))


# Block-level modules (the checkpointed ResBlock/AttentionBlock themselves and the sequences that
# hold them) and modules INSIDE recomputed blocks, whose forward hooks run again in backward.
PATTERNS = ["input_blocks.*", "middle_block", "output_blocks.*", "out",
            r"re:middle_block\.[012](\..*)?", r"re:input_blocks\.1\.0\.(in_layers|out_layers)\.\d"]


def recorded(model) -> list[dict]:
    with ActivationGradRecorder(model, PATTERNS, histogram_bins=8, dump_steps=[3],
                                dump_modules=["middle_block.1", "middle_block.0.in_layers.2"]) as rec:
        rec.arm(3)
        step_grads(model)
        rows = rec.collect()
        dumps = rec.take_dumps()
    return rows, dumps


def test_activation_gradients_are_recorded_once_and_equal_with_checkpointing():
    ref_rows, ref_dumps = recorded(make_model(False))
    rows, dumps = recorded(make_model(True))
    inner = {r["module"] for r in rows if r["module"].startswith("middle_block.0.in_layers")}
    assert inner == {"middle_block.0.in_layers", "middle_block.0.in_layers.0", "middle_block.0.in_layers.1",
                     "middle_block.0.in_layers.2"}
    # Each output gradient once per microbatch (two microbatches), not again in the recompute.
    assert {r["calls"] for r in rows if r["tensor"] == "output"} == {2}
    key = lambda r: (r["module"], r["tensor"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(ref_rows, key=key)  # every statistic, bit for bit
    assert dumps.keys() == ref_dumps.keys() and len(dumps) == 8  # 2 modules x output/input x 2 microbatches
    for k in dumps:
        assert torch.equal(dumps[k], ref_dumps[k]), k
