"""Sample-quality metrics on feature arrays: FID, KID, precision/recall, inception-style score,
conditional accuracy, per-class FID, and a real-vs-real floor at the same sample count.

Everything here is a pure function of numpy arrays, computed in float64. `feature_metrics` is
the one entry point the evaluate stage needs; it standardises both feature sets with the real
set's per-dimension mean and std first (the polynomial KID kernel and the FID scale both assume
features of unit scale; raw classifier features give huge, high-variance KID values).

Why each number is there (see docs/notes on metric reliability):
- global FID/KID/recall see quality loss and dropped modes, but not broken conditioning;
- `accuracy` (evaluator's prediction == conditioning label) and the per-class FIDs see broken
  conditioning;
- precision is unreliable in small classifier spaces (noise collapses into a large k-NN ball):
  read it only together with recall and FID;
- every number is biased by the sample count N: compare only with `real_floor` at the same N.

The optional paper-comparable Inception metrics (`inception_metrics`) go through torch-fidelity
with a local, sha256-verified weights file and never download anything.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
from pathlib import Path

import numpy as np


# --- Fréchet distance -------------------------------------------------------------------------


def feature_statistics(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) of features (N, D), in float64."""
    f = np.asarray(f, np.float64)
    if f.ndim != 2 or len(f) < 2:
        raise ValueError(f"need at least 2 feature vectors (N, D), got shape {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False).reshape(f.shape[1], f.shape[1])


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
    """Symmetric square root of a (numerically) positive semi-definite matrix."""
    w, v = np.linalg.eigh((s + s.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Squared 2-Wasserstein distance between N(mu1, sigma1) and N(mu2, sigma2):

        |mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^(1/2))

    tr((s1 s2)^(1/2)) is computed as the sum of square roots of the eigenvalues of the
    symmetric PSD matrix s1^(1/2) s2 s1^(1/2) (same spectrum as s1 s2), which stays real and
    stable for singular covariances (fewer samples than dimensions).
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != mu1.shape * 2:
        raise ValueError(f"shape mismatch: mu {mu1.shape} {mu2.shape}, sigma {s1.shape} {s2.shape}")
    r1 = _psd_sqrt(s1)
    m = r1 @ s2 @ r1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0.0, None)).sum()
    d = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)
    return max(d, 0.0)  # the true value is >= 0; only rounding can push it below


def fid(f1: np.ndarray, f2: np.ndarray) -> float:
    """Fréchet distance between the Gaussian fits of two feature sets."""
    return frechet_distance(*feature_statistics(f1), *feature_statistics(f2))


# --- KID --------------------------------------------------------------------------------------


def _poly_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (x @ y.T / x.shape[1] + 1.0) ** 3


def _mmd2_unbiased(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD^2 (Bińkowski et al. 2018, eq. 4) with the cubic polynomial kernel; len(x) == len(y)."""
    m = len(x)
    k_xx, k_yy, k_xy = _poly_kernel(x, x), _poly_kernel(y, y), _poly_kernel(x, y)
    sum_xx = k_xx.sum() - np.trace(k_xx)
    sum_yy = k_yy.sum() - np.trace(k_yy)
    return float((sum_xx + sum_yy) / (m * (m - 1)) - 2 * k_xy.sum() / m**2)


def kid(f1: np.ndarray, f2: np.ndarray, subsets: int = 100, subset_size: int = 1000, seed: int = 0
        ) -> tuple[float, float]:
    """Kernel distance: mean and std over `subsets` random subsets (without replacement) of
    unbiased MMD^2 with k(x, y) = (x.y / D + 1)^3. `subset_size` is capped at the smaller set.

    Pass standardised features (as `feature_metrics` does); the kernel assumes unit scale.
    Two independent samples of one distribution give ~0 (either sign). A set against itself
    gives a small negative value: its subsets overlap, putting k(x, x) into the cross term.
    """
    f1, f2 = np.asarray(f1, np.float64), np.asarray(f2, np.float64)
    m = min(subset_size, len(f1), len(f2))
    if m < 2:
        raise ValueError(f"KID needs at least 2 samples per set, got {len(f1)} and {len(f2)}")
    rng = np.random.default_rng(seed)
    mmds = np.array([
        _mmd2_unbiased(f1[rng.choice(len(f1), m, replace=False)], f2[rng.choice(len(f2), m, replace=False)])
        for _ in range(subsets)
    ])
    return float(mmds.mean()), float(mmds.std())


# --- precision / recall -----------------------------------------------------------------------


def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances (len(a), len(b)); exact zero for identical rows."""
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    # The expansion leaves ~1e-13 residue for identical rows; that would put a point outside a
    # zero-radius ball around its own duplicate, so snap tiny values to zero.
    scale = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :]
    d[d <= 1e-12 * scale] = 0.0
    return np.clip(d, 0.0, None)


def _knn_radii_sq(f: np.ndarray, k: int, batch: int) -> np.ndarray:
    """Squared distance of each point to its k-th nearest neighbour in the same set (self excluded)."""
    out = np.empty(len(f))
    for i in range(0, len(f), batch):
        d = _sq_dists(f[i : i + batch], f)
        out[i : i + batch] = np.partition(d, k, axis=1)[:, k]  # column 0 of the sorted row is the point itself
    return out


def _inside_manifold(query: np.ndarray, ref: np.ndarray, radii_sq: np.ndarray, batch: int) -> np.ndarray:
    inside = np.empty(len(query), bool)
    for i in range(0, len(query), batch):
        inside[i : i + batch] = (_sq_dists(query[i : i + batch], ref) <= radii_sq[None, :]).any(1)
    return inside


def precision_recall(f_gen: np.ndarray, f_real: np.ndarray, k: int = 3, batch: int = 2048) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) with k-NN balls.

    precision: fraction of generated points inside the union of the real points' k-NN balls;
    recall: fraction of real points inside the union of the generated points' k-NN balls.
    """
    f_gen, f_real = np.asarray(f_gen, np.float64), np.asarray(f_real, np.float64)
    if min(len(f_gen), len(f_real)) <= k:
        raise ValueError(f"precision/recall with k={k} needs more than {k} samples per set")
    precision = _inside_manifold(f_gen, f_real, _knn_radii_sq(f_real, k, batch), batch).mean()
    recall = _inside_manifold(f_real, f_gen, _knn_radii_sq(f_gen, k, batch), batch).mean()
    return float(precision), float(recall)


# --- classifier-output metrics ----------------------------------------------------------------


def inception_score(logits: np.ndarray, splits: int = 10, seed: int = 0) -> tuple[float, float]:
    """exp(E_x KL(p(y|x) || p(y))), mean and std over `splits` chunks of a seeded shuffle.

    The shuffle matters: samples usually arrive grouped by class, and an unshuffled chunk
    holding one class scores ~1 whatever the quality.
    """
    logits = np.asarray(logits, np.float64)
    splits = max(1, min(splits, len(logits)))
    logits = logits[np.random.default_rng(seed).permutation(len(logits))]
    log_p = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    scores = []
    for chunk in np.array_split(log_p, splits):
        p = np.exp(chunk)
        log_py = np.log(p.mean(0, keepdims=True))
        scores.append(np.exp((p * (chunk - log_py)).sum(1).mean()))
    return float(np.mean(scores)), float(np.std(scores))


def class_accuracy(pred: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of samples whose predicted class equals the label they were conditioned on."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    if pred.shape != labels.shape or pred.ndim != 1:
        raise ValueError(f"pred {pred.shape} and labels {labels.shape} must be equal-length vectors")
    return float((pred == labels).mean())


# --- the entry points -------------------------------------------------------------------------


def standardise(f_gen: np.ndarray, f_real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sets scaled with the real set's per-dimension mean and std (constant dims keep std 1)."""
    f_gen, f_real = np.asarray(f_gen, np.float64), np.asarray(f_real, np.float64)
    mean, std = f_real.mean(0), f_real.std(0)
    std = np.where(std > 1e-12 * max(1.0, np.abs(mean).max(initial=0.0)), std, 1.0)
    return (f_gen - mean) / std, (f_real - mean) / std


def feature_metrics(
    f_gen: np.ndarray,
    y_gen: np.ndarray,
    f_real: np.ndarray,
    y_real: np.ndarray,
    *,
    logits_gen: np.ndarray | None = None,
    k: int = 3,
    seed: int = 0,
    kid_subsets: int = 100,
    kid_subset_size: int = 1000,
    is_splits: int = 10,
) -> dict:
    """All evaluator-space metrics as one flat dict (flat keys become `dvc exp show` columns).

    f_gen (N, D), y_gen (N,) the labels the samples were conditioned on; f_real (M, D),
    y_real (M,). With `logits_gen` (N, K) also `accuracy` and `is`. Keys: n_gen, n_real, fid,
    kid, kid_std, precision, recall, [accuracy, is, is_std], fid_per_class_mean, fid_class_<i>
    for every class i in y_real (None where either side has fewer than 2 samples of i; the mean
    is over the others).
    """
    y_gen, y_real = np.asarray(y_gen), np.asarray(y_real)
    if len(f_gen) != len(y_gen) or len(f_real) != len(y_real):
        raise ValueError(f"features and labels differ in length: gen {len(f_gen)}/{len(y_gen)}, "
                         f"real {len(f_real)}/{len(y_real)}")
    g, r = standardise(f_gen, f_real)
    out: dict = {"n_gen": int(len(g)), "n_real": int(len(r)), "fid": fid(g, r)}
    out["kid"], out["kid_std"] = kid(g, r, kid_subsets, kid_subset_size, seed)
    out["precision"], out["recall"] = precision_recall(g, r, k)
    if logits_gen is not None:
        logits_gen = np.asarray(logits_gen, np.float64)
        out["accuracy"] = class_accuracy(logits_gen.argmax(1), y_gen)
        out["is"], out["is_std"] = inception_score(logits_gen, is_splits, seed)
    per_class = {}
    for c in np.unique(y_real):
        gc, rc = g[y_gen == c], r[y_real == c]
        per_class[int(c)] = fid(gc, rc) if len(gc) >= 2 and len(rc) >= 2 else None
    valid = [v for v in per_class.values() if v is not None]
    out["fid_per_class_mean"] = float(np.mean(valid)) if valid else None
    out.update({f"fid_class_{c}": v for c, v in per_class.items()})
    return out


def real_floor(
    f_real_a: np.ndarray,
    y_real_a: np.ndarray,
    f_real_b: np.ndarray,
    y_real_b: np.ndarray,
    n: int,
    *,
    logits_a: np.ndarray | None = None,
    k: int = 3,
    seed: int = 0,
    **kwargs,
) -> dict:
    """The same metrics real-vs-real: a seeded random subset of n images of set a (in the role of
    the samples, e.g. the train split) against all of set b (the reference, e.g. the test split).

    This is the best score a perfect generator could reach at this N. Keys are `floor_<key>`
    of `feature_metrics`; `floor_n_gen` < n when set a is smaller than n.
    """
    idx = np.sort(np.random.default_rng(seed).permutation(len(f_real_a))[:n])
    logits = None if logits_a is None else np.asarray(logits_a)[idx]
    m = feature_metrics(np.asarray(f_real_a)[idx], np.asarray(y_real_a)[idx], f_real_b, y_real_b,
                        logits_gen=logits, k=k, seed=seed, **kwargs)
    return {f"floor_{key}": v for key, v in m.items()}


# --- optional Inception metrics (paper-comparable) --------------------------------------------

INCEPTION_EXTRACTOR = "inception-v3-compat"  # torch-fidelity's TF-ported 2015-12-05 Inception


class InceptionWeightsError(ValueError):
    """A weights file that is missing or fails its sha256 check; one line naming the file and the fix."""


def verify_sha256(path: str | Path, expected: str) -> bytes:
    """The bytes of `path`, read once; refuses (InceptionWeightsError) unless the file exists and
    the sha256 of those bytes equals `expected`."""
    path = Path(path)
    if not expected:
        raise InceptionWeightsError(
            f"{path}: evaluate.inception_sha256 is empty; give the file's sha256 (the weights of a paper's "
            "Inception are identified by it)")
    if not path.is_file():
        raise InceptionWeightsError(f"{path}: not found; fix evaluate.inception_weights or set it to \"\"")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected.strip().lower():
        raise InceptionWeightsError(
            f"{path}: sha256 {digest} != evaluate.inception_sha256 {expected}; refusing to load it")
    return data


@contextlib.contextmanager
def _verified_weights(path: str | Path, expected: str, *, unpickled_by_fidelity: bool):
    """The weights as the extractor will read them: a private copy of the very bytes whose sha256
    was checked (the file cannot change between the check and the load).

    torch-fidelity's Inception unpickles its weights with weights_only=False, which runs whatever
    code a pickle names; a sha256 the user computed from the file they were given guards nothing.
    So those bytes must first pass torch's safe loader (weights_only=True: tensors and plain
    containers only), which the real weights-inception-2015-12-05 file does."""
    import torch

    data = verify_sha256(path, expected)
    if unpickled_by_fidelity:
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InceptionWeightsError(
                f"{path}: not a plain state dict of tensors, so it is not unpickled (torch's weights_only loader "
                f"refused it: {reason[:200]}); use torch-fidelity's weights-inception-2015-12-05-6726825d.pth") from None
    with tempfile.TemporaryDirectory(prefix="ddpmrepro-inception-") as d:
        copy = Path(d) / Path(path).name
        copy.write_bytes(data)
        yield copy


@contextlib.contextmanager
def _offline_torch_home():
    """TORCH_HOME -> an empty temp dir, so any hub lookup misses the cache and fails visibly."""
    old = os.environ.get("TORCH_HOME")
    with tempfile.TemporaryDirectory(prefix="ddpmrepro-torch-home-") as d:
        os.environ["TORCH_HOME"] = d
        try:
            yield d
        finally:
            if old is None:
                os.environ.pop("TORCH_HOME", None)
            else:
                os.environ["TORCH_HOME"] = old


def _as_rgb_dataset(images: np.ndarray):
    import torch

    x = np.asarray(images)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"expected uint8 images (N, 1 or 3, H, W), got {x.dtype} {x.shape}")
    t = torch.from_numpy(np.ascontiguousarray(x))
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)  # grey -> RGB by replication, as the papers do for MNIST

    class _Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(t)

        def __getitem__(self, i):
            return t[i].contiguous()

    return _Images()


def inception_metrics(
    gen_uint8: np.ndarray,
    real_uint8: np.ndarray,
    weights_path: str | Path | None,
    sha256: str,
    *,
    feature_extractor: str | None = None,
    kid_subset_size: int = 1000,
    k: int = 3,
    batch_size: int = 200,
) -> dict:
    """FID/KID/IS/precision/recall in the TF-ported Inception space (torch-fidelity 0.4.0).

    `weights_path` must be a local copy of torch-fidelity's weights-inception-2015-12-05 file;
    its sha256 must equal `sha256`, and torch's safe loader must accept it (both checked before
    torch-fidelity unpickles it: `_verified_weights`). Nothing is ever downloaded: TORCH_HOME
    points at an empty temp dir during the call. With no path (and no
    stand-in `feature_extractor`), returns only an `inception_status` saying why it was skipped.

    `feature_extractor` names another extractor registered with
    `torch_fidelity.register_feature_extractor` (used by the tests with a small stand-in net);
    it receives a verified copy of `weights_path` the same way (the sha256 only: it loads its own
    weights, as safetensors in the tests).
    """
    if not weights_path and feature_extractor is None:
        return {"inception_status": "skipped: set evaluate.inception_weights to a local "
                "weights-inception-2015-12-05-6726825d.pth file (and evaluate.inception_sha256)"}
    try:
        import torch
        import torch_fidelity
    except ImportError:
        raise InceptionWeightsError("inception metrics need torch-fidelity==0.4.0 "
                                    "(pip install 'ddpmrepro[metrics]')") from None

    n = min(len(gen_uint8), len(real_uint8))
    with contextlib.ExitStack() as stack:
        weights = (stack.enter_context(_verified_weights(weights_path, sha256,
                                                         unpickled_by_fidelity=feature_extractor is None))
                   if weights_path else None)
        stack.enter_context(_offline_torch_home())
        m = torch_fidelity.calculate_metrics(
            input1=_as_rgb_dataset(gen_uint8), input2=_as_rgb_dataset(real_uint8),
            feature_extractor=feature_extractor or INCEPTION_EXTRACTOR,
            feature_extractor_weights_path=str(weights) if weights else None,
            isc=True, fid=True, kid=True, prc=True, kid_subset_size=min(kid_subset_size, n),
            prc_neighborhood=k, batch_size=batch_size, cuda=torch.cuda.is_available(),
            cache=False, save_cpu_ram=True, verbose=False,
        )
    return {
        "inception_status": "ok",
        "inception_fid": float(m["frechet_inception_distance"]),
        "inception_kid": float(m["kernel_inception_distance_mean"]),
        "inception_kid_std": float(m["kernel_inception_distance_std"]),
        "inception_is": float(m["inception_score_mean"]),
        "inception_is_std": float(m["inception_score_std"]),
        "inception_precision": float(m["precision"]),
        "inception_recall": float(m["recall"]),
    }


__all__ = [
    "feature_statistics", "frechet_distance", "fid", "kid", "precision_recall", "inception_score",
    "class_accuracy", "standardise", "feature_metrics", "real_floor", "inception_metrics",
    "verify_sha256", "InceptionWeightsError", "INCEPTION_EXTRACTOR",
]
