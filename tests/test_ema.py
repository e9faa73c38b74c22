import torch

from ddpmrepro.training.ema import ema_decay, init_ema, update_ema


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


def test_a_reused_updater_follows_in_place_updates_and_loaded_weights():
    """The loop resolves the live tensors once; optimizer steps and load_state_dict must still show."""
    from ddpmrepro.training.ema import EmaUpdater

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # with buffers
    ema, ref = init_ema(model), init_ema(model)
    updater = EmaUpdater(ema, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.randn(8, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:  # as on resume: weights replaced in place
            model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
        updater(0.5)
        update_ema(ref, model, 0.5)  # resolves the tensors afresh each time
    for k in ema:
        assert torch.equal(ema[k], ref[k]), k
    assert not torch.equal(ema["0.weight"], init_ema(model)["0.weight"])


def test_the_ema_object_equals_the_recurrence_per_rate_and_round_trips_its_state():
    """EMA (what the loop holds): every rate follows ema <- d ema + (1 - d) w with the shared warmup
    count, and a copy loaded from its state_dict continues exactly as the original."""
    from ddpmrepro.training.ema import EMA

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, [0.9, 0.2], warmup=True)
    expected = {r: init_ema(model) for r in (0.9, 0.2)}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for n in range(6):
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        for r in expected:
            d = min(r, (1 + n) / (10 + n))
            for k, v in model.state_dict().items():
                expected[r][k] = d * expected[r][k] + (1 - d) * v
        if n == 2:  # as on resume: a new object loaded from the state, tracking the same live model
            state = ema.state_dict()
            ema = EMA(model, [0.9, 0.2], warmup=True)
            ema.load_state_dict(state)
            assert ema.num_updates == 3
    for r in expected:
        for k in expected[r]:
            assert torch.allclose(ema.export()[r][k], expected[r][k], atol=1e-6), (r, k)
    assert not torch.equal(ema.export()[0.9]["weight"], ema.export()[0.2]["weight"])


def test_an_ema_state_of_other_rates_is_refused():
    import pytest

    from ddpmrepro.training.ema import EMA

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="rates"):
        EMA(model, [0.9], warmup=False).load_state_dict(EMA(model, [0.99], warmup=False).state_dict())
