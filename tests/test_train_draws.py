"""batches.example_draws: each example's draws are exactly those of a fresh generator seeded by its
seed, whatever the image shape (the bitwise resume and DDP-equivalence guarantees rest on it)."""
import pytest
import torch

from ddpmrepro.training.batches import example_draws, step_seed


def fresh_generator_draws(seeds, shape):
    """The definition: a new generator per example, the three uniforms first, then the noise."""
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    u = torch.stack([torch.rand(3, generator=g, dtype=torch.float64) for g in gens])
    noise = torch.stack([torch.randn(shape, generator=g) for g in gens])
    return u, noise


# (1, 1, 3): fewer than 16 values take torch's scalar normal path, which caches every second
# Box-Muller sample in the generator: a reused generator must not carry it to the next example.
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (1, 1, 3), (2, 3, 5)])
def test_example_draws_equal_a_fresh_generator_per_example(shape):
    seeds = [step_seed(0, 7, i, 1) for i in range(37)]
    u, noise = example_draws(seeds, shape)
    ref_u, ref_noise = fresh_generator_draws(seeds, shape)
    assert u.dtype == torch.float64 and noise.dtype == torch.float32 and noise.shape == (37, *shape)
    assert torch.equal(u, ref_u) and torch.equal(noise, ref_noise)
    # An example's draws depend on its seed only, not on its neighbours in the batch.
    u1, noise1 = example_draws(seeds[5:6], torch.Size(shape))
    assert torch.equal(u1[0], u[5]) and torch.equal(noise1[0], noise[5])


def test_an_upsamplers_augmentation_draws_come_after_and_leave_the_others_unchanged():
    seeds = [step_seed(0, 3, i, 1) for i in range(9)]
    u, noise = example_draws(seeds, (1, 8, 8))
    u2, noise2, u_aug, noise_aug = example_draws(seeds, (1, 8, 8), (1, 4, 4))
    assert torch.equal(u, u2) and torch.equal(noise, noise2)  # a base model's numbers, whatever the model
    for i, s in enumerate(seeds):  # the definition: the same generator goes on with one uniform, then the noise
        g = torch.Generator().manual_seed(s)
        torch.rand(3, generator=g, dtype=torch.float64), torch.randn((1, 8, 8), generator=g)
        assert torch.equal(u_aug[i:i + 1], torch.rand(1, generator=g, dtype=torch.float64))
        assert torch.equal(noise_aug[i], torch.randn((1, 4, 4), generator=g))


# --- the draws on the read-ahead thread: the numbers of the synchronous code they replaced ---------


def synchronous_microbatch(rows, idx, labels, *, micro, seed, rank, world, num_classes, label_dropout, hflip,
                           superres, sampler):
    """The microbatch as the training loop made it on its own thread before the draws moved to the
    reader's (session 12's TrainExamples.microbatch, written out): float images first, then the draws."""
    from ddpmrepro.data import to_model_range
    from ddpmrepro.model.superres import augment, low_res_input

    x0 = to_model_range(rows)
    seeds = [step_seed(seed, micro, rank + world * i, 1) for i in range(len(idx))]
    low_shape = (x0.shape[1], superres.low_res, superres.low_res) if superres.low_res else None
    u, noise, *aug = example_draws(seeds, x0.shape[1:], low_shape)
    if hflip:
        x0 = torch.where((u[:, 1] < 0.5)[:, None, None, None], x0.flip(-1), x0)
    y = labels[idx]
    y = torch.where(u[:, 0] < label_dropout, torch.full_like(y, num_classes), y)
    t, weights = sampler.sample_from_uniform(u[:, 2])
    cond = {}
    if superres.low_res:
        cond["low_res"] = low_res_input(x0, superres.low_res, superres.quantise)
        if superres.noise_aug:
            level = (aug[0] * superres.noise_aug).float()
            cond = {"low_res": augment(cond["low_res"], level, aug[1]), "aug_level": level}
    return {"x0": x0, "y": y, "t": t, "weights": weights, "noise": noise, **cond}


@pytest.mark.parametrize("hflip", [False, True])
@pytest.mark.parametrize("low_res, noise_aug", [(0, 0.0), (4, 0.0), (4, 0.2)])
def test_draws_made_ahead_give_the_microbatch_of_the_synchronous_code_bitwise(hflip, low_res, noise_aug):
    from ddpmrepro.params import SuperresParams
    from ddpmrepro.training.batches import TrainExamples
    from ddpmrepro.training.timestep_sampler import LossSecondMomentSampler

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (40,), generator=g)
    idx = torch.randperm(40, generator=g)[:16]
    sampler = LossSecondMomentSampler(50, history=2)  # a non-uniform state: its weights enter t and the weights
    for _ in range(2):
        sampler.update(torch.arange(50), torch.rand(50, generator=g, dtype=torch.float64) + torch.arange(50) / 10)
    sr = SuperresParams(low_res=low_res, noise_aug=noise_aug, sample_noise_aug=0.0)
    kw = dict(seed=3, rank=1, world=2, num_classes=10, label_dropout=0.3, hflip=hflip, superres=sr)
    examples = TrainExamples(labels, **kw)
    mb = examples.microbatch(examples.draws(7, idx, images[idx]), sampler).to(torch.device("cpu"))
    want = synchronous_microbatch(images[idx], idx, labels, micro=7, sampler=sampler, **kw)
    got = {"x0": mb.x0, "y": mb.y, "t": mb.t, "weights": mb.weights, "noise": mb.noise, **mb.cond}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert hflip == bool(mb.flip is not None and mb.flip.any())  # the flip case flips something


def test_train_hflip_overrides_the_datas_rule():
    """train.hflip: null follows the manifest's hflip_ok (true for image folders and CIFAR-10, false
    for digits); false turns mirroring off for images a mirror changes (found from outside: an image
    folder of text or arrows was always flipped), true turns it on; each setting is its own run."""
    from ddpmrepro import params as P
    from ddpmrepro.training.loop import flips, run_hash

    folder, digits = {"hflip_ok": True}, {"hflip_ok": False}
    unset, off, on = (P.TrainParams(hflip=v) for v in (None, False, True))
    assert (flips(unset, folder), flips(unset, digits)) == (True, False)
    assert (flips(off, folder), flips(on, digits)) == (False, True)
    hashes = {v: run_hash(P.from_dict({"train": {"hflip": v}}), "d") for v in (None, False, True)}
    assert len(set(hashes.values())) == 3  # each setting its own run directory
