"""Metrics against independent truth: closed forms, second implementations (scipy, torch-fidelity),
and failure modes on digits that the metrics must catch, each compared with a real-vs-real floor."""
from __future__ import annotations

import collections
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch

from ddpmrepro.evaluation import metrics as M
from ddpmrepro.evaluation.evaluator import fit_evaluator, load_evaluator
from ddpmrepro.params import EvaluatorParams


pytestmark = pytest.mark.usefixtures("one_thread")


def _random_cov(rng, d, n=None):
    a = rng.normal(size=(d, n or 2 * d))
    return a @ a.T / a.shape[1]


def _fd_scipy(mu1, s1, mu2, s2):
    """Second implementation: scipy's sqrtm of the (non-symmetric) product, as pytorch-fid does."""
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


# --- Fréchet distance -------------------------------------------------------------------------


def test_frechet_identical_gaussians_is_zero():
    rng = np.random.default_rng(0)
    mu, s = rng.normal(size=16), _random_cov(rng, 16)
    assert M.frechet_distance(mu, s, mu, s) == pytest.approx(0.0, abs=1e-9)
    f = rng.normal(size=(50, 8))
    assert M.fid(f, f) == pytest.approx(0.0, abs=1e-9)


def test_frechet_matches_closed_form_for_diagonal_covariances():
    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=10), rng.normal(size=10)
    a, b = rng.uniform(0.1, 4, 10), rng.uniform(0.1, 4, 10)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert M.frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("d, n", [(8, None), (64, None), (32, 10)])  # (32, 10): singular, rank 10
def test_frechet_matches_scipy_sqrtm(d, n):
    rng = np.random.default_rng(d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    s1, s2 = _random_cov(rng, d, n), _random_cov(rng, d, n)
    assert M.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_fd_scipy(mu1, s1, mu2, s2), rel=1e-6, abs=1e-6)


def test_frechet_matches_torch_fidelity():
    tf = pytest.importorskip("torch_fidelity.metric_fid")
    rng = np.random.default_rng(2)
    f1, f2 = rng.normal(size=(300, 20)), rng.normal(0.3, 1.2, size=(280, 20))
    ref = tf.fid_statistics_to_metric(tf.fid_features_to_statistics(torch.from_numpy(f1)),
                                      tf.fid_features_to_statistics(torch.from_numpy(f2)), False)
    assert M.fid(f1, f2) == pytest.approx(ref["frechet_inception_distance"], rel=1e-6)


# --- KID --------------------------------------------------------------------------------------


def test_kid_of_a_set_with_itself_is_near_zero_and_shift_is_positive():
    rng = np.random.default_rng(3)
    f = rng.normal(size=(400, 16))
    same, _ = M.kid(f, f, subsets=20, subset_size=200, seed=0)
    shifted, _ = M.kid(f, f + 0.5, subsets=20, subset_size=200, seed=0)
    small, _ = M.kid(f, f + 0.2, subsets=20, subset_size=200, seed=0)
    other, _ = M.kid(f, rng.normal(size=(400, 16)), subsets=20, subset_size=200, seed=0)
    # Against itself the subsets overlap, which puts k(x, x) terms into the cross sum: slightly
    # negative (-0.037 here), i.e. zero next to any real difference.
    assert abs(same) < 0.05 and abs(other) < 0.02
    assert shifted > 20 * abs(same) and small > 2 * abs(same) and shifted > small > 0


def test_kid_matches_naive_unbiased_mmd_and_torch_fidelity():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(30, 5)), rng.normal(0.2, 1.0, size=(30, 5))
    k = lambda a, b: (a @ b / 5 + 1) ** 3  # noqa: E731
    m = len(x)
    naive = (sum(k(x[i], x[j]) + k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
             - 2 * sum(k(x[i], y[j]) for i in range(m) for j in range(m)) / m**2)
    # One subset of the full size is a permutation of each set: the estimate is exact.
    assert M.kid(x, y, subsets=1, subset_size=m, seed=0)[0] == pytest.approx(naive, rel=1e-12)
    tk = pytest.importorskip("torch_fidelity.metric_kid")
    ref = tk.kid_features_to_metric(torch.from_numpy(x), torch.from_numpy(y), kid_subsets=1, kid_subset_size=m,
                                    verbose=False)
    assert M.kid(x, y, subsets=1, subset_size=m)[0] == pytest.approx(ref["kernel_inception_distance_mean"], rel=1e-10)


# --- precision / recall -----------------------------------------------------------------------


def test_precision_recall_identical_sets_is_one_and_disjoint_is_zero():
    rng = np.random.default_rng(5)
    f = rng.normal(size=(200, 8))
    assert M.precision_recall(f, f, k=3) == (1.0, 1.0)
    dup = np.repeat(f[:20], 10, axis=0)  # duplicates: zero k-NN radii must still contain the point itself
    assert M.precision_recall(dup, dup, k=3) == (1.0, 1.0)
    assert M.precision_recall(f + 100.0, f, k=3) == (0.0, 0.0)


def test_precision_recall_matches_torch_fidelity():
    tp = pytest.importorskip("torch_fidelity.metric_prc")
    rng = np.random.default_rng(6)
    gen, real = rng.normal(0.3, 1.3, size=(250, 10)), rng.normal(size=(300, 10))
    ref = tp.prc_features_to_metric(torch.from_numpy(gen), torch.from_numpy(real), prc_neighborhood=3,
                                    prc_batch_size=1000, save_cpu_ram=False, verbose=False)
    p, r = M.precision_recall(gen, real, k=3, batch=64)
    assert (p, r) == pytest.approx((ref["precision"], ref["recall"]), abs=1e-6)  # theirs is a float32 mean
    assert 0.0 < p < 1.0 and 0.0 < r < 1.0  # a non-trivial case


# --- classifier-output metrics ----------------------------------------------------------------


def test_inception_score_extremes_and_torch_fidelity():
    k = 10
    confident = np.eye(k)[np.repeat(np.arange(k), 20)] * 50.0  # (200, 10), one class per sample, balanced
    assert M.inception_score(confident, splits=1)[0] == pytest.approx(k, rel=1e-6)
    # Samples sorted by class: the seeded shuffle keeps every split balanced (unshuffled splits would score ~1).
    assert M.inception_score(confident, splits=10)[0] > 7.0
    assert M.inception_score(np.tile([50.0] + [0.0] * (k - 1), (200, 1)), splits=1)[0] == pytest.approx(1.0)
    ti = pytest.importorskip("torch_fidelity.metric_isc")
    logits = np.random.default_rng(7).normal(0, 3, size=(500, k))
    ref = ti.isc_features_to_metric(torch.from_numpy(logits), splits=1, shuffle=False)
    assert M.inception_score(logits, splits=1)[0] == pytest.approx(ref["inception_score_mean"], rel=1e-12)


def test_class_accuracy():
    assert M.class_accuracy(np.array([0, 1, 2, 2]), np.array([0, 1, 1, 2])) == 0.75
    with pytest.raises(ValueError):
        M.class_accuracy(np.zeros(3), np.zeros(4))


# --- entry points -----------------------------------------------------------------------------


def _blobs(rng, n_per_class, classes=4, d=6, shift=0.0):
    centres = np.arange(classes)[:, None] * 3.0 * np.eye(classes, d)
    y = np.repeat(np.arange(classes), n_per_class)
    return centres[y] + rng.normal(size=(len(y), d)) + shift, y


def test_feature_metrics_keys_and_standardisation():
    rng = np.random.default_rng(8)
    fg, yg = _blobs(rng, 60)
    fr, yr = _blobs(rng, 70)
    logits = np.eye(4)[yg] * 5.0
    m = M.feature_metrics(fg, yg, fr, yr, logits_gen=logits, k=3, seed=0, kid_subsets=10)
    expected = {"n_gen", "n_real", "fid", "kid", "kid_std", "precision", "recall", "accuracy", "is", "is_std",
                "fid_per_class_mean"} | {f"fid_class_{c}" for c in range(4)}
    assert set(m) == expected
    assert m["accuracy"] == 1.0 and m["n_gen"] == 240 and m["n_real"] == 280
    assert m["fid_per_class_mean"] == pytest.approx(np.mean([m[f"fid_class_{c}"] for c in range(4)]))
    # Standardised with the real set's statistics: an affine change of feature units changes nothing.
    scale, offset = rng.uniform(0.01, 100, 6), rng.normal(size=6) * 50
    m2 = M.feature_metrics(fg * scale + offset, yg, fr * scale + offset, yr, logits_gen=logits, kid_subsets=10)
    for key in expected:
        assert m2[key] == pytest.approx(m[key], rel=1e-6, abs=1e-9), key
    # A class the samples lack gets None and is left out of the mean.
    keep = yg != 3
    m3 = M.feature_metrics(fg[keep], yg[keep], fr, yr, kid_subsets=10)
    assert m3["fid_class_3"] is None and "accuracy" not in m3
    assert m3["fid_per_class_mean"] == pytest.approx(np.mean([m3[f"fid_class_{c}"] for c in range(3)]))


def test_real_floor_uses_n_samples_of_set_a():
    rng = np.random.default_rng(9)
    fa, ya = _blobs(rng, 100)
    fb, yb = _blobs(rng, 50)
    fl = M.real_floor(fa, ya, fb, yb, 120, logits_a=np.eye(4)[ya], seed=1, kid_subsets=10)
    assert fl["floor_n_gen"] == 120 and fl["floor_n_real"] == 200 and fl["floor_accuracy"] == 1.0
    assert all(k.startswith("floor_") for k in fl)
    assert fl["floor_recall"] > 0.7 and fl["floor_fid"] < 1.0


# --- failure modes on digits, against the real-vs-real floor ----------------------------------


@pytest.fixture(scope="module")
def digits_eval(tmp_path_factory):
    """A trained evaluator plus features of the test split (reference) and of the train split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.rint(d.images * 255 / 16).astype(np.uint8)[:, None]  # prepared format: uint8 (N, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, d.target.astype(np.int64), test_size=0.2, stratify=d.target,
                                          random_state=0)
    out = tmp_path_factory.mktemp("ev") / "evaluator"
    fit = fit_evaluator(xtr, ytr, xte, yte, EvaluatorParams(), out, num_classes=10,
                        class_names=[str(i) for i in range(10)], num_threads=1)
    ev = load_evaluator(out)
    f_te, _ = ev.features_and_logits(xte)
    f_tr, l_tr = ev.features_and_logits(xtr)
    n = len(xte)
    floor = M.real_floor(f_tr, ytr, f_te, yte, n, logits_a=l_tr, seed=0)
    floor = {k.removeprefix("floor_"): v for k, v in floor.items()}
    print(f"\nevaluator {fit}\nfloor (N={n}): {_fmt(floor)}")

    def score(images, labels, name):
        f, logits = ev.features_and_logits(images)
        m = M.feature_metrics(f, labels, f_te, yte, logits_gen=logits, seed=0)
        print(f"{name:>16}: {_fmt(m)}")
        return m

    return {"ev": ev, "floor": floor, "score": score, "data": (xtr, xte, ytr, yte), "n": n}


def _fmt(m):
    keys = ("fid", "kid", "precision", "recall", "accuracy", "is", "fid_per_class_mean")
    return " ".join(f"{k}={m[k]:.3f}" for k in keys if m.get(k) is not None)


def _train_subset(digits_eval, seed):
    xtr, _, ytr, _ = digits_eval["data"]
    idx = np.sort(np.random.default_rng(seed).permutation(len(xtr))[: digits_eval["n"]])
    return xtr[idx], ytr[idx]


def test_real_data_scores_at_the_floor(digits_eval):
    floor = digits_eval["floor"]
    assert floor["accuracy"] >= 0.97 and floor["recall"] >= 0.7 and floor["precision"] >= 0.7
    assert floor["fid"] < 5.0 and abs(floor["kid"]) < 0.1 and floor["is"] > 7.0
    # Another real subset of the same N lands within the floor's own sampling noise.
    m = digits_eval["score"](*_train_subset(digits_eval, 1), "real (seed 1)")
    assert m["fid"] < floor["fid"] + 3.0 and abs(m["kid"]) < 0.1
    assert m["recall"] > floor["recall"] - 0.1 and m["accuracy"] >= 0.97
    assert m["fid_per_class_mean"] < 2 * floor["fid_per_class_mean"] + 2.0


def test_shuffled_labels_break_accuracy_but_not_global_fid(digits_eval):
    floor = digits_eval["floor"]
    x, y = _train_subset(digits_eval, 0)  # the floor's own images, so global metrics must match it exactly
    y_shuffled = np.random.default_rng(0).permutation(y)
    m = digits_eval["score"](x, y_shuffled, "shuffled labels")
    assert m["accuracy"] < 0.2
    assert m["fid"] == pytest.approx(floor["fid"], abs=0.5) and m["recall"] == pytest.approx(floor["recall"], abs=0.05)
    assert m["fid_per_class_mean"] > 10 * floor["fid_per_class_mean"]


def test_sampler_that_drops_half_the_classes(digits_eval):
    """Asked for class c >= 5 it draws a real image of class c - 5: five modes are gone."""
    floor = digits_eval["floor"]
    xtr, _, ytr, _ = digits_eval["data"]
    x, y = _train_subset(digits_eval, 2)
    x = x.copy()
    rng = np.random.default_rng(2)
    for i in np.flatnonzero(y >= 5):
        x[i] = xtr[rng.choice(np.flatnonzero(ytr == y[i] - 5))]
    m = digits_eval["score"](x, y, "drops 5 classes")
    assert m["fid"] > 10 * floor["fid"] and m["fid"] > floor["fid"] + 20
    assert m["recall"] < floor["recall"] - 0.25
    assert m["kid"] > 0.2 and m["accuracy"] < 0.6 and m["is"] < 0.7 * floor["is"]


def test_uniform_noise_scores_badly_on_every_metric(digits_eval):
    floor = digits_eval["floor"]
    _, y = _train_subset(digits_eval, 3)
    x = np.random.default_rng(3).integers(0, 256, (len(y), 1, 8, 8), dtype=np.uint8)
    m = digits_eval["score"](x, y, "uniform noise")
    assert m["accuracy"] < 0.2
    assert m["fid"] > 30 * floor["fid"] and m["kid"] > 1.0
    assert m["recall"] < 0.25 and m["recall"] < floor["recall"] / 3
    assert m["is"] < 3.0 and m["fid_per_class_mean"] > 20 * floor["fid_per_class_mean"]
    # Precision is known to be unreliable here (noise collapses into large k-NN balls): only require
    # that it is below the floor, and never use it alone.
    assert m["precision"] < floor["precision"]


# --- optional Inception metrics: plumbing with a stand-in extractor -----------------------------


def test_inception_skipped_without_weights():
    m = M.inception_metrics(np.zeros((4, 1, 8, 8), np.uint8), np.zeros((4, 1, 8, 8), np.uint8), "", "")
    assert set(m) == {"inception_status"} and m["inception_status"].startswith("skipped: set evaluate.inception_weights")


def test_inception_refuses_unverified_weights(tmp_path):
    w = tmp_path / "weights.pth"
    w.write_bytes(b"pretend pickle")
    imgs = np.zeros((4, 3, 8, 8), np.uint8)
    with pytest.raises(M.InceptionWeightsError, match="inception_sha256 is empty"):
        M.inception_metrics(imgs, imgs, w, "")
    with pytest.raises(M.InceptionWeightsError, match="refusing to load"):
        M.inception_metrics(imgs, imgs, w, "0" * 64)
    with pytest.raises(M.InceptionWeightsError, match="not found"):
        M.inception_metrics(imgs, imgs, tmp_path / "absent.pth", "0" * 64)


class _RunsCode:
    """Unpickling this calls `marker.touch()`: what a weights file from a stranger can do to an
    unpickler with weights_only=False, as torch-fidelity's Inception loader is."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_inception_weights_that_would_run_code_are_refused_whatever_their_sha256(tmp_path):
    """The sha256 is the user's own, computed from the file they were given: it cannot vouch for
    the file. Its bytes must also pass torch's weights_only loader before torch-fidelity unpickles
    them; real weights (an OrderedDict of tensors) do."""
    import hashlib

    marker = tmp_path / "code-ran"
    evil = tmp_path / "weights-inception-2015-12-05-6726825d.pth"
    torch.save({"conv.weight": torch.zeros(2), "x": _RunsCode(marker)}, evil)
    imgs = np.zeros((4, 3, 8, 8), np.uint8)
    with pytest.raises(M.InceptionWeightsError, match="not a plain state dict of tensors, so it is not unpickled"):
        M.inception_metrics(imgs, imgs, evil, hashlib.sha256(evil.read_bytes()).hexdigest())
    assert not marker.exists()
    plain = tmp_path / "plain.pth"
    torch.save(collections.OrderedDict(w=torch.ones(3)), plain)
    with M._verified_weights(plain, hashlib.sha256(plain.read_bytes()).hexdigest(), unpickled_by_fidelity=True) as copy:
        assert copy != plain and copy.read_bytes() == plain.read_bytes()  # what torch-fidelity reads: the checked bytes
    assert not copy.exists()


STANDIN = "ddpmrepro-test-standin"


def _register_standin():
    """A small random conv net behind torch-fidelity's feature-extractor interface. It loads its
    weights (safetensors) from feature_extractor_weights_path, like the Inception extractor does."""
    tf = pytest.importorskip("torch_fidelity")
    from safetensors.torch import load_file
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    class StandIn(FeatureExtractorBase):
        seen = {}

        def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
            super().__init__(name, features_list)
            StandIn.seen["torch_home"] = os.environ.get("TORCH_HOME")
            self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.fc = torch.nn.Linear(16, 5)
            self.load_state_dict(load_file(feature_extractor_weights_path))

        @staticmethod
        def get_provided_features_list():
            return ("feat", "logits")

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return {"isc": "logits", "fid": "feat", "kid": "feat", "prc": "feat"}[metric]

        @staticmethod
        def can_be_compiled():
            return False

        @staticmethod
        def get_dummy_input_for_compile():
            return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)

        def forward(self, x):
            assert x.dtype == torch.uint8 and x.shape[1] == 3, "extractor must get uint8 RGB"
            f = torch.tanh(self.conv(x.float() / 127.5 - 1)).mean((2, 3))
            out = {"feat": f, "logits": self.fc(f)}
            return tuple(out[k] for k in self.features_list)

    if STANDIN not in FEATURE_EXTRACTORS_REGISTRY:
        tf.register_feature_extractor(STANDIN, StandIn)
    return FEATURE_EXTRACTORS_REGISTRY[STANDIN]


def test_inception_plumbing_with_standin_extractor(tmp_path, monkeypatch):
    import hashlib

    from safetensors.torch import save_file

    cls = _register_standin()
    g = torch.Generator().manual_seed(0)
    w = tmp_path / "standin.safetensors"
    save_file({"conv.weight": torch.randn(16, 3, 3, 3, generator=g), "conv.bias": torch.zeros(16),
               "fc.weight": torch.randn(5, 16, generator=g), "fc.bias": torch.zeros(5)}, w)
    sha = hashlib.sha256(w.read_bytes()).hexdigest()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "user-torch-home"))

    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (60, 1, 8, 8), dtype=np.uint8)
    same = M.inception_metrics(grey, grey, w, sha, feature_extractor=STANDIN, kid_subset_size=50)
    assert same["inception_status"] == "ok"
    assert same["inception_fid"] == pytest.approx(0.0, abs=1e-3)
    assert same["inception_precision"] == 1.0 and same["inception_recall"] == 1.0
    other = M.inception_metrics(grey, np.zeros_like(grey), w, sha, feature_extractor=STANDIN)
    assert other["inception_fid"] > 1e-2 and other["inception_recall"] < 1.0
    assert all(np.isfinite(v) for k, v in other.items() if k != "inception_status")
    # Hub lookups were pointed at an empty temp dir during the call, and the user's setting is back.
    assert cls.seen["torch_home"] not in (None, str(tmp_path / "user-torch-home"))
    assert os.environ["TORCH_HOME"] == str(tmp_path / "user-torch-home")
    # The sha256 check guards the stand-in path too.
    with pytest.raises(M.InceptionWeightsError, match="refusing to load"):
        M.inception_metrics(grey, grey, w, "f" * 64, feature_extractor=STANDIN)
