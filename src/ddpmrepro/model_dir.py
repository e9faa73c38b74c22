"""The model directory (`models/ddpm/`): the one format `train` and `import` write and `sample`,
`evaluate` and `export` read.

    model.safetensors          the raw weights (train; import when it is given no EMA rate)
    ema_<rate>.safetensors     one per EMA rate, as listed in config.json's `ema_rates`
    phema/                     post-hoc EMA snapshots (`train.posthoc_ema`): the power-function
                               average of one length after some step, `step_<N>-sigma_<length>.safetensors`
                               with metadata naming its length, step, update count and run; from them
                               `sample.ema_length` makes the average of another length (`reconstruct`)
      SHA256SUMS               the sha256 of each snapshot, taken when training wrote it, in
                               `sha256sum`'s format; every reconstruction checks the files against it
    loss_weight.safetensors    the learned loss weighting u(t) (`diffusion.loss_weighting: learned`): its
                               state and the curve `u` over t; read by the report, never by sampling
    SHA256SUMS                 the sha256 of each weights file above and of config.json, taken as they
                               were written; a reader checks the file it loads against it (a directory
                               written before the sums were kept has none, and is read unchecked; one
                               whose config.json says `"checksums": "SHA256SUMS"` must have them)
    config.json                `params` (resolved: the sections train reads, `params.trained_dict`), `data` (`DATA_KEYS` of the manifest it was made
                               for), `ema_rates`, `torch`, and what made it: train adds the data's
                               sha256, the code version, the run hash and the last logged values;
                               import adds the architecture as built and the `source` file

The producers build config.json (each has its own provenance keys, in an order that is part of the
bytes DVC hashes); this module checks what every reader relies on, writes the directory whole
(`files.replacing_dir`) and builds the network back from it.
"""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from . import files, outputs
from .model import phema
from .model.superres import build_superres
from .model.unet import UNet, build_unet
from .params import Params, ParamsError, check_ema_step, snapshot_steps, trained_from_dict

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
LOSS_WEIGHT_FILE = "loss_weight.safetensors"  # diffusion.loss_weighting: learned (training/learned_weighting.py)
PHEMA_DIR = "phema"
SNAPSHOT = re.compile(r"^step_(\d{9})-sigma_(.+)\.safetensors$")
SNAPSHOT_FORMAT = "ddpmrepro-phema-1"
MANIFEST_FILE = "SHA256SUMS"  # of the snapshots, in `sha256sum`'s format: `<hex>  <name>` per line
MAX_FIT_ERROR = phema.MAX_FIT_ERROR  # checked from params alone by pipeline/check_params.py too
DATA_KEYS = ("source", "num_classes", "image_size", "channels", "class_names")


def weights_file(ema_rate: float) -> str:
    """The file of the EMA at `ema_rate`; rate 0 means the raw weights."""
    return f"ema_{ema_rate:g}.safetensors" if ema_rate else MODEL_FILE


def data_section(manifest: dict) -> dict:
    """config.json's `data`: what a reader needs of the prepared data, without the data itself."""
    return {k: manifest[k] for k in DATA_KEYS}


# --- writing ---------------------------------------------------------------------------------------


def write_model(out: Path, config: dict, weights: dict[str, torch.Tensor] | None,
                emas: dict[float, dict[str, torch.Tensor]], snapshots: Path | None = None,
                loss_weight: dict[str, torch.Tensor] | None = None) -> None:
    """Writes the model directory `out` whole: it holds the old directory or all of the new one.

    :param config: config.json's content, written as `json.dumps(config, indent=2)`; its
        `ema_rates` must list the keys of `emas`, in order.
    :param weights: the raw weights (model.safetensors), or None where there are none (an import of
        one EMA).
    :param emas: rate -> EMA weights.
    :param snapshots: a run directory's post-hoc EMA snapshots, put into `phema/` as hard links (one
        copy on disk; a copy where the two directories are on different file systems), each checked
        against the run directory's SHA256SUMS first, which goes with them (its snapshot files
        only: a killed writer's temp file stays behind).
    :param loss_weight: the learned loss weighting's tensors (LOSS_WEIGHT_FILE), where trained with
        `diffusion.loss_weighting: learned`; never read by sampling.
    """
    with files.replacing_dir(out, outputs.MODEL) as tmp:
        write_model_into(tmp, config, weights, emas, snapshots=snapshots, loss_weight=loss_weight)


def write_model_into(tmp: Path, config: dict, weights: dict[str, torch.Tensor] | None,
                     emas: dict[float, dict[str, torch.Tensor]], snapshots: Path | None = None,
                     loss_weight: dict[str, torch.Tensor] | None = None) -> None:
    """`write_model`'s files, into the empty directory `tmp` that `files.replacing_dir` gave (train
    puts its three outputs in place one after the other once all are written)."""
    missing = [k for k in ("params", "data", "ema_rates") if k not in config]
    if missing or list(config["ema_rates"]) != list(emas) or weights is None and not emas:
        raise ValueError(f"not a model directory's config.json (missing {missing}, ema_rates "
                         f"{config.get('ema_rates')} for EMA weights {list(emas)})")
    if weights is not None:
        files.save_weights(weights, tmp / MODEL_FILE)
    for rate, ema in emas.items():
        files.save_weights(ema, tmp / weights_file(rate))
    if loss_weight is not None:
        files.save_weights(loss_weight, tmp / LOSS_WEIGHT_FILE)
    # Taken from the bytes just written: a file damaged or edited later no longer matches.
    add_to_manifest(tmp, {f.name: files.sha256(f) for f in sorted(tmp.glob("*.safetensors"))})
    names = sorted(f.name for f in snapshots.iterdir() if SNAPSHOT.match(f.name)) if snapshots else []
    if names:
        (tmp / PHEMA_DIR).mkdir()
        for name in names:
            files.link_or_copy(snapshots / name, tmp / PHEMA_DIR / name)
        # Checked as exported: a snapshot damaged in the run directory fails the train stage, not
        # a later sample, and is never given a fresh sum.
        digests = verify_snapshots(tmp / PHEMA_DIR, sums_from=snapshots, fix="retrain (`ddpmrepro train "
                                   "--restart`)")
        add_to_manifest(tmp / PHEMA_DIR, digests)
    # Says that the directory was written with its sums: without it, a SHA256SUMS emptied or
    # deleted read as a directory from before the sums were kept, and nothing was checked.
    config = {**config, "checksums": MANIFEST_FILE}
    files.atomic_write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2))
    # config.json says what network and diffusion the weights are: an edit there (T=1000 for a
    # model trained with T=50) would load and sample without an error, so it is summed as well.
    add_to_manifest(tmp, {CONFIG_FILE: files.sha256(tmp / CONFIG_FILE)})


# --- reading ---------------------------------------------------------------------------------------


def model_dir_of(path: Path) -> Path:
    """The model directory a file or folder of it belongs to (`phema/` and its snapshots are in one)."""
    path = Path(path)
    return path.parent if path.name == PHEMA_DIR else path


def restore(model_dir: Path) -> str:
    """The fix for a model directory found damaged: the directory as the user named it (the cascade's
    are models/base and models/upsampler, not the main pipeline's models/ddpm)."""
    return f"restore the model directory (`dvc checkout {model_dir_of(model_dir)}`) or retrain"


def damaged_fix(path: Path, model_dir: Path, fix: str | None = None) -> str:
    """What to do about a file of `model_dir` whose sum differs (`fix`, where the caller has its own).
    Outputs are hard links to DVC's cache (.dvc/config), and the snapshots to the run's checkpoint
    directory too: bytes damaged through one name are damaged in every one, and `dvc checkout`
    would put back the same bytes."""
    if fix is not None:
        return fix
    try:
        links = os.stat(path).st_nlink
    except OSError:
        links = 1
    if links < 2:
        return restore(model_dir)
    return (f"its bytes are shared by {links} hard links (DVC's cache, the run's checkpoint directory), so "
            f"`dvc checkout` cannot restore them: `dvc pull --force {model_dir_of(model_dir)}` from a remote, or "
            "retrain with `ddpmrepro train --restart` (a `dvc repro` would find the damaged run finished)")


def require_config(model_dir: Path) -> Path:
    """The path of config.json in a model directory; CheckpointError (one line) where there is none.
    Cheap: the launchers call it before they wait for cores or GPUs (a wrong --model said at once)."""
    model_dir = Path(model_dir)
    files.recover_dir(model_dir)  # a writer killed mid-swap where directories cannot be exchanged
    path = model_dir / CONFIG_FILE
    if not path.exists():
        raise files.CheckpointError(f"{path}: not found; train first (`dvc repro train`)")
    return path


def read_config(model_dir: Path) -> dict:
    """config.json of a model directory, checked against SHA256SUMS where they list it (directories
    written before they did are not) and in its shape; CheckpointError (one line) where there is
    none, or it is damaged or edited."""
    model_dir = Path(model_dir)
    path = require_config(model_dir)
    listed = CONFIG_FILE in read_manifest(model_dir)
    if listed:
        check_weights_file(model_dir, CONFIG_FILE)
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise files.CheckpointError(f"{path}: not valid JSON ({str(e).splitlines()[0]}); {restore(model_dir)}") from None
    if not listed and isinstance(config, dict) and config.get("checksums") == MANIFEST_FILE:
        raise files.CheckpointError(f"{model_dir / MANIFEST_FILE}: missing, or it does not list {CONFIG_FILE}, in a "
                                    "directory written with its sums: nothing in it can be checked; " + restore(model_dir))
    problem = config_problem(config)
    if problem:
        raise files.CheckpointError(f"{path}: {problem}; {restore(model_dir)}")
    return config


def config_problem(config) -> str | None:
    """What keeps `config` from describing a model directory's weights, or None."""
    if not isinstance(config, dict):
        return f"a JSON {type(config).__name__}, not an object"
    for key, kind in (("params", dict), ("data", dict), ("ema_rates", list)):
        if not isinstance(config.get(key), kind):
            return f"'{key}' is {'missing' if key not in config else type(config[key]).__name__}, not a {kind.__name__}"
    data = config["data"]
    for key in ("num_classes", "image_size", "channels"):
        if type(data.get(key)) is not int or data[key] < 0:
            return f"data.{key} is {data.get(key)!r}, not a whole number"
    names = data.get("class_names")
    if not isinstance(names, list) or len(names) != data["num_classes"]:
        return f"data.class_names does not name data.num_classes={data['num_classes']} classes"
    if not all(type(r) in (int, float) and 0 <= r < 1 for r in config["ema_rates"]):
        return f"ema_rates {config['ema_rates']!r} are not EMA rates in [0, 1)"
    try:
        trained_from_dict(config["params"])
    except ParamsError as e:
        return f"params: {e}"
    return None


def build_model(trained: Params, data: dict) -> UNet:
    """The network (fresh weights) that params `trained` and config.json's `data` describe. An
    upsampler (superres.low_res > 0) is IDDPM's super-resolution UNet. `import` builds its target
    with this too, so what it writes is what `load_model` reads back."""
    shape = dict(image_size=data["image_size"], in_channels=data["channels"], num_classes=data["num_classes"],
                 learn_sigma=trained.diffusion.variance == "learned_range")
    if trained.superres.low_res:
        return build_superres(trained.model, trained.superres, **shape)
    return build_unet(trained.model, **shape)


def load_model(model_dir: Path, ema_rate: float, device="cpu", *, ema_length: float = 0.0, ema_step: int = 0):
    """(the network with the chosen EMA weights (rate 0: the raw weights; `ema_length` > 0: the
    post-hoc EMA of that length, reconstructed from the snapshots, instead; as it stood after step
    `ema_step`, 0 = the last), eval mode on `device`; the params it was made with; config.json)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    trained = trained_from_dict(config["params"])
    if not ema_length and ema_rate and ema_rate not in [float(r) for r in config["ema_rates"]]:
        raise ParamsError(f"sample.ema_rate={ema_rate:g} was not trained; available: "
                          f"{', '.join(f'{float(r):g}' for r in config['ema_rates'])} (or 0 for raw weights)")
    name = weights_file(ema_rate)
    model = build_model(trained, config["data"])
    if ema_length:
        name = f"{PHEMA_DIR}/ (sample.ema_length={ema_length:g})"
        state = reconstruct(model_dir / PHEMA_DIR, ema_length, trained.train, run_hash=config.get("run_hash", ""),
                            at_step=ema_step)
    else:
        check_weights_file(model_dir, name)
        state = files.load_weights(model_dir / name)
    expected = model.state_dict()
    missing = set(expected) ^ set(state)
    if missing:
        raise files.CheckpointError(f"{model_dir / name}: tensors do not match the architecture in config.json "
                                    f"(e.g. {sorted(missing)[0]}); retrain or restore the model directory")
    wrong = [k for k in expected if state[k].shape != expected[k].shape]
    if wrong:
        k = wrong[0]
        raise files.CheckpointError(f"{model_dir / name}: {k} is {list(state[k].shape)}, but config.json's network "
                                    f"has {list(expected[k].shape)} ({len(wrong)} tensors differ); {restore(model_dir)}")
    bad = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:  # every image would be NaN, written as black with exit 0
        raise files.CheckpointError(f"{model_dir / name}: {bad} holds NaN or infinite values (a diverged run or a "
                                    f"damaged file); {restore(model_dir)}")
    model.load_state_dict(state)
    return model.to(device).eval(), trained, config


# --- post-hoc EMA snapshots -------------------------------------------------------------------------


def snapshot_file(step: int, sigma_rel: float) -> str:
    return f"step_{step:09d}-sigma_{float(sigma_rel)!r}.safetensors"


def snapshot_metadata(*, sigma_rel: float, step: int, updates: int, run_hash: str) -> dict[str, str]:
    """What a snapshot file says of itself: one metadata key holding sorted JSON. (safetensors writes
    its metadata map in Rust's HashMap order, random per process: with several keys, a resumed run's
    snapshots would differ from the uninterrupted run's in the bytes DVC hashes.)"""
    what = {"sigma_rel": float(sigma_rel), "step": step, "updates": updates, "run_hash": run_hash}
    return {SNAPSHOT_FORMAT: json.dumps(what, sort_keys=True)}


@dataclass(frozen=True)
class Snapshot:
    path: Path
    sigma_rel: float
    step: int
    updates: int  # t: the updates its average has seen (the steps less the skipped ones)
    run_hash: str


def list_snapshots(directory: Path) -> list[Snapshot]:
    """The snapshot files of `directory` by step (other names, such as a killed writer's temp file, ignored)."""
    out = []
    for path in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
        if SNAPSHOT.match(path.name):
            try:
                meta = json.loads(files.weights_metadata(path)[SNAPSHOT_FORMAT])
                out.append(Snapshot(path, float(meta["sigma_rel"]), int(meta["step"]), int(meta["updates"]),
                                    str(meta["run_hash"])))
            except (KeyError, ValueError, TypeError):
                raise ParamsError(f"{path}: not a post-hoc EMA snapshot of ddpmrepro (no '{SNAPSHOT_FORMAT}' "
                                  "metadata); remove it") from None
    return sorted(out, key=lambda s: (s.step, s.sigma_rel))


def check_snapshots(snaps: list[Snapshot], directory: Path, train, *, run_hash: str, key: str) -> None:
    """The snapshots are exactly those the run of config.json wrote: none missing, none foreign."""
    if not snaps:
        raise ParamsError(f"{key}: {directory} holds no post-hoc EMA snapshots (trained with train.posthoc_ema: "
                          "[], imported, or trained before it existed); set sample.ema_length: 0 to use "
                          "sample.ema_rate, or retrain with train.posthoc_ema")
    for s in snaps:
        if s.run_hash != run_hash:
            raise ParamsError(f"{key}: {s.path} is a snapshot of run {s.run_hash}, not of this model's run "
                              f"{run_hash}; {restore(directory)}")
    have = {(s.step, s.sigma_rel) for s in snaps}
    want = {(step, float(sigma)) for step in snapshot_steps(train.steps, train.posthoc_ema_snapshots)
            for sigma in train.posthoc_ema}
    if have - want:
        step, sigma = min(have - want)
        raise ParamsError(f"{key}: {directory / snapshot_file(step, sigma)} is not one of this run's snapshots "
                          f"(train.posthoc_ema: {list(train.posthoc_ema)}); remove it")
    if want - have:
        step, sigma = min(want - have)
        raise ParamsError(f"{key}: {directory / snapshot_file(step, sigma)} is missing ({len(want - have)} of "
                          f"{len(want)} snapshots); {restore(directory)}")


def read_manifest(directory: Path) -> dict[str, str]:
    """name -> sha256 of `directory`'s SHA256SUMS ({} where there is none)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            raise files.CheckpointError(f"{path}: not a SHA256SUMS file (line {line[:80]!r}); {restore(directory)}")
        out[name] = digest
    return out


def check_weights_file(model_dir: Path, name: str) -> None:
    """`name` against the model directory's SHA256SUMS: one CheckpointError line where it differs or
    is not listed. A directory without one (written before the sums were kept) is not checked."""
    sums = read_manifest(model_dir)
    if not sums:
        return
    path = Path(model_dir) / name
    if name not in sums:
        raise files.CheckpointError(f"{path}: not listed in {Path(model_dir) / MANIFEST_FILE}, so it cannot be "
                                    f"checked; {restore(model_dir)}")
    if path.exists() and files.sha256(path) != sums[name]:
        raise files.CheckpointError(f"{path}: sha256 differs from {Path(model_dir) / MANIFEST_FILE} (damaged or "
                                    f"modified since it was written); {damaged_fix(path, model_dir)}")


def add_to_manifest(directory: Path, digests: dict[str, str]) -> None:
    """Adds (or replaces) these files' sums in `directory`'s SHA256SUMS, rewritten atomically."""
    sums = {**read_manifest(directory), **digests}
    files.atomic_write_text(Path(directory) / MANIFEST_FILE, "".join(f"{sums[n]}  {n}\n" for n in sorted(sums)))


def verify_snapshots(directory: Path, *, sums_from: Path | None = None, shown: Path | None = None,
                     fix: str | None = None) -> dict[str, str]:
    """Hashes every snapshot file of `directory` once and checks it against the SHA256SUMS of
    `sums_from` (default: `directory`); returns name -> sha256. A file that differs or is not
    listed, or no SHA256SUMS, is one CheckpointError line naming the file (in `shown`, default
    `sums_from`) and `fix`. A listed file that is not there is `check_snapshots`' to name."""
    directory = Path(directory)
    sums_from = Path(sums_from) if sums_from else directory
    shown, manifest = Path(shown) if shown else sums_from, sums_from / MANIFEST_FILE
    names = sorted(p.name for p in directory.iterdir() if SNAPSHOT.match(p.name)) if directory.is_dir() else []
    if names and not manifest.exists():
        raise files.CheckpointError(f"{manifest}: not found, so the snapshots cannot be checked (written before "
                                    f"ddpmrepro kept their sums); {fix or restore(directory)}, or, if you trust them, write it: "
                                    f"(cd {shown} && sha256sum step_*.safetensors > {MANIFEST_FILE})")
    want = read_manifest(sums_from)
    for name in names:
        if name not in want:
            raise files.CheckpointError(f"{shown / name}: not listed in {manifest}, so it cannot be checked; "
                                        f"remove it or {fix or restore(directory)}")
    # hashlib releases the GIL per block: a few threads hash several files at once.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(names)))) as pool:
        digests = dict(zip(names, pool.map(lambda n: files.sha256(directory / n), names)))
    for name in names:
        if digests[name] != want[name]:
            raise files.CheckpointError(f"{shown / name}: sha256 differs from {manifest} (damaged or modified "
                                        f"since it was written); {damaged_fix(directory / name, directory, fix)}")
    return digests


def reconstruct(directory: Path, length: float, train, *, run_hash: str, at_step: int = 0) -> dict[str, torch.Tensor]:
    """The averaged weights of EMA length `length` at the end of the run, or as they stood after
    step `at_step` (> 0) (name -> fp32 tensor), from the snapshots in `directory` of the run
    `run_hash` trained with `train` (TrainParams). Reads one snapshot at a time: memory is two copies
    of the weights (the fp64 sum, one snapshot). Every file is checked against SHA256SUMS first (a
    damaged one: one CheckpointError line, exit 1); every other failure is one ParamsError line
    (exit 2); both before anything is written."""
    key = f"sample.ema_length={length:g}" + (f", sample.ema_step={at_step}" if at_step else "")
    verify_snapshots(directory)
    snaps = list_snapshots(directory)
    check_snapshots(snaps, directory, train, run_hash=run_hash, key=key)
    if at_step:
        # The average of length `length` at that step is made from what existed then: the snapshots
        # up to it, whose profiles all end by it (EDM2's solve targets any time, not only the last).
        check_ema_step(at_step, train)
        snaps = [s for s in snaps if s.step <= at_step]
    # An average of no update is the initialisation (no profile); steps skipped in a row give two
    # snapshots of one average (the same updates and length): keep one.
    snaps = list({(s.updates, s.sigma_rel): s for s in snaps if s.updates > 0}.values())
    if not snaps:
        raise ParamsError(f"{key}: every step of the run was skipped; there is no average to make")
    c, err = phema.solve([(s.updates, s.sigma_rel) for s in snaps], max(s.updates for s in snaps), length)
    if err > MAX_FIT_ERROR:
        raise ParamsError(f"{key}: the snapshots of lengths {', '.join(f'{s:g}' for s in train.posthoc_ema)} "
                          f"make it only to a profile error of {err:.1e} (at most {MAX_FIT_ERROR:g}); choose a "
                          "length nearer those, or track it or more snapshots (train.posthoc_ema, "
                          "train.posthoc_ema_snapshots)")
    total: dict[str, torch.Tensor] = {}
    for s, ci in zip(snaps, c):
        weights = files.load_weights(s.path)
        if total and weights.keys() != total.keys():
            raise ParamsError(f"{key}: {s.path} holds other tensors than {snaps[0].path}; {restore(directory)}")
        for k, v in weights.items():
            total.setdefault(k, torch.zeros_like(v, dtype=torch.float64)).add_(v.double(), alpha=float(ci))
    return {k: v.float() for k, v in total.items()}


__all__ = ["MODEL_FILE", "CONFIG_FILE", "LOSS_WEIGHT_FILE", "PHEMA_DIR", "SNAPSHOT", "SNAPSHOT_FORMAT", "MANIFEST_FILE", "MAX_FIT_ERROR",
           "read_manifest", "add_to_manifest", "verify_snapshots",
           "snapshot_file", "snapshot_metadata", "snapshot_steps", "check_ema_step", "Snapshot", "list_snapshots", "check_snapshots",
           "reconstruct", "DATA_KEYS", "weights_file", "data_section", "write_model", "read_config",
           "build_model", "load_model"]
