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
