import torch

from ddpmrepro.ema import ema_decay, init_ema, update_ema


def test_update_matches_the_recurrence():
    model = torch.nn.Linear(3, 2)
    ema = init_ema(model)
    expected = {k: v.clone() for k, v in ema.items()}
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = ema_decay(0.9, step, warmup=True)
        update_ema(ema, model, d)
        for k, v in model.state_dict().items():
            expected[k] = d * expected[k] + (1 - d) * v
    for k in ema:
        assert torch.allclose(ema[k], expected[k], atol=1e-6)


def test_warmup_decay():
    assert ema_decay(0.9999, 0, warmup=True) == 0.1
    assert ema_decay(0.9999, 10**7, warmup=True) == 0.9999
    assert ema_decay(0.9999, 0, warmup=False) == 0.9999
