"""The `check_params` stage: params.yaml validated before any other stage runs.

DVC removes a stage's outputs before it runs the stage's command, so a typo caught by the
command itself (`train.bogus_key: 1`) used to cost the user `models/ddpm/` and the dvclive
files. `check_params` is the first stage of the pipeline and every other stage depends on one
of its outputs, so `dvc repro` and `dvc exp run` run it first and stop there; it depends on
the whole params.yaml file, so a misspelt section name (`trian:`) is caught too.

Its outputs are the params resolved per section (`<out>/<section>.yaml`, defaults filled in):
a stage depends on the files of the sections it reads, so editing `train.lr` changes
`train.yaml` only and prepare still does not rerun. The files are `persist` outputs: DVC
leaves them in place while the check runs, and they are rewritten only when their content
changes, so a failed check touches nothing at all.

Besides what `params.load` checks (each key, and the keys one stage reads together), the check here
holds the stages to each other as the pipeline chains them (`check_pipeline`): the run `sample`
reads is the one `train` made with this very file, so a post-hoc EMA length the run keeps no
snapshots for, a fixed-rate EMA it does not train, a network its constructor refuses, or an
introspection pattern that matches no module of the model it builds are refused now, not after
training (tests/test_check_params.py holds
every stage-time refusal that depends on the params alone to a case this check refuses).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from ..files import atomic_write_text, project_root_for
from ..model import phema, schedules
from ..params import Params, ParamsError, levels_measured_at, load, snapshot_steps
from ..training.noise_buckets import checked_layout

HEADER = "# Written by `ddpmrepro check-params` from params.yaml, defaults filled in. Do not edit.\n"


def section_files(out_dir: Path) -> dict[str, Path]:
    """The resolved-params file of every params section."""
    return {name: Path(out_dir) / f"{name}.yaml" for name in Params().to_dict()}


def write_resolved(params: Params, out_dir: Path) -> list[Path]:
    """Writes `<out_dir>/<section>.yaml` for every section whose content changed (an unchanged
    file keeps its mtime, which Snakemake reads); returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, path in section_files(out_dir).items():
        text = resolved_text(params, name)
        if not path.is_file() or path.read_text() != text:
            atomic_write_text(path, text)  # whole or absent
            written.append(path)
    return written


def resolved_as_they_are(out_dir: Path) -> dict[Path, tuple[bytes, int]]:
    """The resolved files' bytes and mtimes, for `put_back_resolved` (the Snakefile writes them at
    parse time, before it knows whether the run will start)."""
    return {path: (path.read_bytes(), path.stat().st_mtime_ns)
            for path in section_files(Path(out_dir)).values() if path.is_file()}


def put_back_resolved(out_dir: Path, before: dict[Path, tuple[bytes, int]]) -> None:
    """A run refused before its first job leaves the resolved files as they were (found from outside:
    a refused `snakemake` left reports/params/train.yaml saying `device: cuda`, and `dvc status`
    then showed train stale after params.yaml was put back)."""
    for path in section_files(Path(out_dir)).values():
        if path in before:
            data, mtime = before[path]
            if not path.is_file() or path.read_bytes() != data:
                atomic_write_text(path, data.decode())
                os.utime(path, ns=(mtime, mtime))
        elif path.is_file():
            path.unlink()


def check_ema_length(length: float, at_step: int, train) -> None:
    """`sample.ema_length` (as it stood after `at_step`, 0 = the last step) must be a length the run of
    `train` (TrainParams) can make: it keeps post-hoc EMA snapshots, and they make that profile closely
    (`phema.solve` on the snapshots' steps and lengths; `model_dir.reconstruct` solves again with the
    updates the run really made, which steps skipped under fp16 lower)."""
    key = f"sample.ema_length={length:g}" + (f", sample.ema_step={at_step}" if at_step else "")
    if not train.posthoc_ema:
        raise ParamsError(f"{key}: train.posthoc_ema is [], so the run keeps no post-hoc EMA snapshots to make it "
                          "from; track lengths (e.g. train.posthoc_ema: [0.05, 0.10]) or set sample.ema_length: 0")
    end = at_step or train.steps
    steps = [s for s in snapshot_steps(train.steps, train.posthoc_ema_snapshots) if s <= end]
    _, err = phema.solve([(s, sigma) for s in steps for sigma in train.posthoc_ema], end, length)
    if err > phema.MAX_FIT_ERROR:
        raise ParamsError(f"{key}: the snapshots of lengths {', '.join(f'{s:g}' for s in train.posthoc_ema)} "
                          f"make it only to a profile error of {err:.1e} (at most {phema.MAX_FIT_ERROR:g}); choose a "
                          "length nearer those, or track it or more snapshots (train.posthoc_ema, "
                          "train.posthoc_ema_snapshots)")


# What the network `train` builds depends on, and the introspection patterns matched against it.
MODEL_SECTIONS = ("data", "model", "superres", "diffusion", "introspect")


def resolved_text(params: Params, section: str) -> str:
    """`<section>.yaml` as write_resolved writes it."""
    return HEADER + yaml.safe_dump({section: params.to_dict()[section]}, sort_keys=False)


def passed_before(params: Params, checked: Path | None, sections, keys: dict[str, tuple[str, ...]] | None = None) -> bool:
    """Whether `checked` (this stage's resolved files, which only a check that passed writes) holds
    these `sections` as they are now, and these `keys` of others: what depends on them alone was
    checked then."""
    if checked is None:
        return False
    for name in (*sections, *(keys or {})):
        path = Path(checked) / f"{name}.yaml"
        if not path.is_file():
            return False
        if name in sections:
            if path.read_text() != resolved_text(params, name):
                return False
            continue
        try:
            before = (yaml.safe_load(path.read_text()) or {}).get(name) or {}
        except yaml.YAMLError:
            return False
        now = params.to_dict()[name]
        if any(k not in before or before[k] != now[k] for k in keys[name]):
            return False
    return True


# What the timestep samplers' checks replay (the draws of t, and when the history fills): an edit
# of anything else in these sections (train.lr, say) is checked without torch.
SAMPLER_KEYS = {"diffusion": ("timesteps",),
                "train": ("seed", "steps", "batch_per_proc", "nproc", "nodes", "grad_accum", "timestep_sampler")}


def check_model(params: Params, num_classes: int | None, checked: Path | None = None) -> None:
    """Builds the network `train` builds from these params on the meta device (names and shapes, no
    memory), so that what its constructor refuses (attention heads that do not divide a level's
    width, an image size its levels cannot halve) and `introspect.params`/`modules` patterns that
    match nothing are refused here, before DVC removes train's outputs, not by train after.

    It imports torch (seconds, on every Snakemake parse), so it is skipped where `checked` (this
    stage's resolved files) already holds every section the network depends on as it is now: only
    a check that passed wrote them (tests/test_check_params.py)."""
    if passed_before(params, checked, MODEL_SECTIONS):
        return
    import torch

    from ..model.superres import build_superres
    from ..model.unet import build_unet
    from ..training.recording import gradient_recorders

    shape = dict(image_size=params.data.image_size, in_channels=params.data.channels,
                 num_classes=num_classes or 10,  # the class count sizes an embedding, never a name
                 learn_sigma=params.diffusion.variance == "learned_range")
    try:
        with torch.device("meta"):
            model = build_superres(params.model, params.superres, **shape) if params.superres.low_res else \
                build_unet(params.model, **shape)
    except ValueError as e:  # the constructor's own words name the values
        raise ParamsError(f"model: {e}") from None
    gradient_recorders(model, params.introspect)[1].close()  # the recorders train builds: the same refusals


def check_noise_buckets(params: Params) -> None:
    """The noise-level buckets of `introspect:` in t or in the schedule's log-SNR: edges inside the
    schedule, each bucket expecting 2 examples a step at the global batch (the rule
    `training/noise_levels.py` measures with: `noise_buckets.checked_layout`)."""
    ip, t = params.introspect, params.train
    try:
        checked_layout(schedules.alphas_cumprod(params.diffusion.schedule, params.diffusion.timesteps),
                       buckets=ip.noise_buckets, edges=ip.noise_bucket_edges, space=ip.noise_bucket_space,
                       batch_per_step=t.batch_per_proc * t.grad_accum * t.nproc * t.nodes)
    except ValueError as e:
        raise ParamsError(str(e)) from None


def prepared_manifest(params: Params, data_dir: Path | None) -> dict | None:
    """The manifest of `data_dir` when `prepare` made it from this file's `data:` section (the data
    `train` will read); None when absent or made from other params (prepare runs first then)."""
    path = Path(data_dir) / "manifest.json" if data_dir else None
    if path is None or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # prepare remakes it; train verifies the data it reads
    return manifest if manifest.get("params") == params.to_dict()["data"] else None


def check_batch_fits(params: Params, train_images: int, where) -> None:
    """A rank's batch must fit in its share of the training images (train refuses it otherwise)."""
    t = params.train
    per_rank = train_images // (t.nproc * t.nodes)
    if per_rank < t.batch_per_proc and not t.import_from:
        raise ParamsError(f"train.batch_per_proc={t.batch_per_proc} is larger than this rank's {per_rank} "
                          f"training images ({where}); lower it")


def check_data_source(params: Params, data_dir: Path | None) -> None:
    """The raw data as `prepare` lists it (`data.check_source`: data.root, an image folder's classes,
    names and links, and its training images against the batch; no image decoded). Run by the
    check_params stage, before DVC or Snakemake removes data/prepared to run prepare, and at every
    run of it: an edit of the folder alone (the folder a dependency of check_params and prepare,
    docs/DATA.md) must be refused before prepare too, and listing costs little (a million files:
    about 6 s, measured from outside). Not at each SLURM job's parse of the Snakefile.

    Skipped where data.root is not there and `data_dir` holds data prepared from these params:
    what train reads is there (a DVC experiment's temporary clone holds no DVC-tracked raw data)."""
    root = Path(params.data.root).expanduser()
    if not root.exists() and prepared_manifest(params, data_dir) is not None:
        return
    from ..data.prepared import check_source  # PIL and the readers: only where prepare will run
    from ..data.sources import DataError
    try:
        train_images = check_source(params.data)
    except DataError as e:
        msg, in_dvc_clone = str(e), project_root_for(Path(".")) != Path(".")
        if in_dvc_clone and not root.exists():
            msg += (f"; DVC does not copy DVC-tracked data into an experiment's temporary clone (DVC issue 10744): "
                    f"queue it with `-C {params.data.root}`, or run it in the workspace")
        raise ParamsError(msg) from None
    except OSError as e:  # a folder it may not list, say: one line, as prepare says it
        raise ParamsError(f"{os.fsdecode(e.filename or params.data.root)}: cannot be read ({e.strerror}); "
                          "check its permissions or fix data.root") from None
    if train_images is not None:
        check_batch_fits(params, train_images, f"{params.data.root}, as prepare will split it")


def check_conflict_steps(params: Params) -> None:
    """`report.conflict_steps` must be steps whose noise-level buckets the training measures: the
    report drew other steps in their place, saying nothing (found from outside)."""
    ip, t = params.introspect, params.train
    if not params.report.conflict_steps or t.import_from:
        return
    if ip.noise_buckets == 0 and not ip.noise_bucket_edges:
        raise ParamsError("report.conflict_steps: the noise-level buckets are off (introspect.noise_buckets: 0), "
                          "so no step has a conflict matrix; set report.conflict_steps: [] or turn the buckets on")

    def measured(step: int) -> bool:
        return 1 <= step <= t.steps and levels_measured_at(step, ip, last=t.steps)
    for step in params.report.conflict_steps:
        if not measured(step):
            below = next((s for s in range(min(step, t.steps + 1) - 1, max(0, step - 100_000), -1) if measured(s)), None)
            above = next((s for s in range(step + 1, min(t.steps, step + 100_000) + 1) if measured(s)), None)
            nearest = " or ".join(str(s) for s in (below, above) if s is not None)
            raise ParamsError(f"report.conflict_steps: step {step} is not one where the noise-level buckets are "
                              f"measured (introspect.every, noise_levels_every and steps, of train.steps {t.steps})"
                              + (f"; the nearest: {nearest}" if nearest else ""))


def check_base_pipeline(params: Params) -> None:
    """The project's own pipeline (dvc.yaml, the Snakefile: params.yaml) trains a base model and
    samples it with `ddpmrepro sample`, which refuses an upsampler. With `superres.low_res` set there,
    train would train one (dvc.yaml does not list the superres keys as train's params, so on a
    trained project DVC would not even rerun it) and sample refuse it after. The cascade's pipeline
    (cascade/, its own params files) is where upsamplers are trained and sampled."""
    if params.superres.low_res:
        raise ParamsError(f"superres.low_res: {params.superres.low_res} would train an upsampler, which this "
                          "pipeline's sample stage (`ddpmrepro sample`, a base model's) cannot sample; set low_res: "
                          "0 here and train upsamplers in the cascade (cascade/upsampler.yaml, docs/SUPERRES.md)")


def check_pipeline(params: Params, data_dir: Path | None = None, checked: Path | None = None) -> None:
    """What the stages would refuse of each other, as the pipeline chains them (one ParamsError line):
    `sample` and `evaluate` read the run that `train` makes from the same file, `train` reads the data
    `prepare` made (its manifest, where it is already there) and builds its network from the file.
    `checked`: the resolved files of the last check that passed (`check_model` skips what they hold)."""
    s, t = params.sample, params.train
    check_noise_buckets(params)
    if t.timestep_sampler != "uniform" and not passed_before(params, checked, ("introspect",), SAMPLER_KEYS):
        from ..training import timestep_sampler as ts  # torch (a second): only where what it replays changed
        ts.check_steers(params, processes=t.nproc * t.nodes)  # every node's: the run's world size
        if note := ts.check_history_fills(params, processes=t.nproc * t.nodes):
            print(note, file=sys.stderr)
    if s.ema_length:
        check_ema_length(s.ema_length, s.ema_step, t)
    elif s.ema_rate and not t.import_from and s.ema_rate not in t.ema_rates:
        # An imported model's rates are its own (model_dir.load_model checks those).
        raise ParamsError(f"sample.ema_rate: {s.ema_rate:g} is not one of train.ema_rates "
                          f"({', '.join(f'{r:g}' for r in t.ema_rates)}), so no such weights are trained; "
                          "pick one of those, or 0 for the raw weights")
    if s.guidance and t.label_dropout == 0 and params.model.class_cond and not t.import_from:
        raise ParamsError(f"sample.guidance: {s.guidance:g} needs the null label, which train.label_dropout: 0 never "
                          "trains; set sample.guidance: 0, or train.label_dropout > 0 (0.1 is usual)")
    sr = params.superres
    if sr.low_res and sr.project and params.data.image_size % sr.low_res:
        raise ParamsError(f"superres.project: data.image_size {params.data.image_size} is not a whole multiple of "
                          f"superres.low_res {sr.low_res}, so downsampling is not a block mean to project on; set "
                          "project: false")
    check_conflict_steps(params)
    manifest = prepared_manifest(params, data_dir)
    # An image folder that is there is counted from its listing (check_data_source): the manifest is
    # of the folder as prepare last saw it, and prepare reruns first where it has changed since.
    listed = params.data.source == "image_folder" and Path(params.data.root).expanduser().exists()
    if manifest and not listed:
        check_batch_fits(params, sum(manifest["counts"]["train"]), data_dir)
    check_model(params, manifest["num_classes"] if manifest else None, checked)


def check_params_file(path: str | Path = "params.yaml", out_dir: str | Path | None = None,
                      data_dir: str | Path | None = "data/prepared", *, write: bool = True) -> Params:
    """For the Snakefile: a bad params file exits as the stages do (one line, exit code 2).

    With `out_dir` (the check_params stage's --out), the resolved files are also brought up to
    date, so that DVC's status, which the Snakefile asks next, already shows which stages a
    params edit makes stale (their resolved section changed); the check_params job then only
    records what is there. `write=False` (each job's own parse of the Snakefile, on SLURM a
    process per job) only reads them: where they hold the network's sections as they are, the
    network is not built again (no torch import per job).
    """
    try:
        params = load(path)
        check_base_pipeline(params)  # the Snakefile beside dvc.yaml (the cascade's calls no check_params_file)
        check_pipeline(params, Path(data_dir) if data_dir else None, Path(out_dir) if out_dir else None)
        if write:  # Snakemake's main process: once a run, before any job (a job's parse need not list the data)
            check_data_source(params, Path(data_dir) if data_dir else None)
    except ParamsError as e:
        msg = str(e) if str(e).startswith(str(path)) else f"{path}: {e}"
        print(f"Error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    if out_dir is not None and write:
        write_resolved(params, Path(out_dir))
    return params
