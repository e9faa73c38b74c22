"""params.yaml as typed, frozen dataclasses, validated once at load.

Every field declares its type and, where it matters, the allowed values or range.
A wrong key, type or value raises `ParamsError` naming the key's full path and
what is allowed, before any stage writes anything.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .respace import space_timesteps


class ParamsError(ValueError):
    """A user error in params.yaml; the message is one line naming the key path."""


def _f(default, *, choices=None, min=None, max=None, min_exclusive=False, doc=""):
    """A dataclass field with validation metadata (lists are copied per instance)."""
    meta = {"choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataParams:
    source: str = _f("digits", choices=("digits", "mnist5k", "mnist", "fashion_mnist", "cifar10", "image_folder"))
    root: str = _f("data/raw")
    image_size: int = _f(8, min=4, max=1024)
    channels: int = _f(1, choices=(1, 3))
    test_fraction: float = _f(0.2, min=0.0, max=0.9, min_exclusive=True)
    split_seed: int = _f(0, min=0)
    download: bool = _f(False)


@dataclass(frozen=True)
class ModelParams:
    """A named preset (see unet.PRESETS); any key given here overrides that preset's value."""

    preset: str = _f("tiny", choices=("tiny", "ddpm-cifar10", "iddpm-cifar10"))
    channels: int | None = _f(None, min=1)
    channel_mult: list[int] | None = _f(None, min=1)
    num_res_blocks: int | None = _f(None, min=1)
    attention_resolutions: list[int] | None = _f(None, min=1)
    num_head_channels: int | None = _f(None, min=1)
    dropout: float | None = _f(None, min=0.0, max=1.0)
    scale_shift_norm: bool | None = _f(None)

    def overrides(self) -> dict:
        """The architecture keys set explicitly in params.yaml."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "preset" and v is not None}


@dataclass(frozen=True)
class DiffusionParams:
    timesteps: int = _f(1000, min=2, max=100_000)
    schedule: str = _f("cosine", choices=("linear", "cosine"))
    prediction: str = _f("eps", choices=("eps", "x0"))
    variance: str = _f("fixed_small", choices=("fixed_small", "fixed_large", "learned_range"))
    loss: str = _f("mse", choices=("mse", "hybrid", "kl"))


@dataclass(frozen=True)
class TrainParams:
    seed: int = _f(0, min=0)
    steps: int = _f(1500, min=1)
    batch_per_proc: int = _f(128, min=1)
    grad_accum: int = _f(1, min=1)
    nproc: int = _f(1, min=1, max=1024)
    device: str = _f("auto", choices=("auto", "cpu", "cuda"))
    precision: str = _f("fp32", choices=("fp32", "fp16", "bf16"))
    lr: float = _f(2e-3, min=0.0, min_exclusive=True, max=1.0)
    warmup_steps: int = _f(100, min=0)
    anneal: str = _f("linear", choices=("none", "linear"))
    weight_decay: float = _f(0.0, min=0.0)
    grad_clip: float = _f(1.0, min=0.0)
    ema_rates: list[float] = _f([0.999])
    ema_warmup: bool = _f(True)
    timestep_sampler: str = _f("loss-second-moment", choices=("uniform", "loss-second-moment"))
    label_dropout: float = _f(0.1, min=0.0, max=1.0)
    checkpoint_every: int = _f(500, min=1)
    keep_checkpoints: int = _f(2, min=1)
    log_every: int = _f(25, min=1)
    on_nonfinite: str = _f("error", choices=("error", "skip"))
    max_restarts: int = _f(0, min=0, max=100)


@dataclass(frozen=True)
class IntrospectParams:
    every: int = _f(25, min=0)
    steps: list[int] = _f([1], min=1)
    params: list[str] = _f(["*"])
    update_ratio: bool = _f(True)
    modules: list[str] = _f(["input_blocks.*", "middle_block", "output_blocks.*", "out"])
    histogram_bins: int = _f(0, min=0, max=1024)
    dump_steps: list[int] = _f([], min=1)
    dump_modules: list[str] = _f([])
    dump_max_mb: float = _f(16.0, min=0.0)


@dataclass(frozen=True)
class SampleParams:
    ema_rate: float = _f(0.999, min=0.0, max=1.0)
    per_class: int = _f(50, min=1)
    sampler: str = _f("ddim", choices=("ddim", "ddpm"))
    respacing: str = _f("ddim50")
    eta: float = _f(0.0, min=0.0, max=1.0)
    guidance: float = _f(0.5, min=0.0)
    seed: int = _f(0, min=0)
    batch_size: int = _f(250, min=1)
    nproc: int = _f(1, min=1, max=1024)


@dataclass(frozen=True)
class EvaluatorParams:
    seed: int = _f(0, min=0)
    epochs: int = _f(30, min=1)
    lr: float = _f(1e-3, min=0.0, min_exclusive=True)
    batch_size: int = _f(128, min=1)


@dataclass(frozen=True)
class EvaluateParams:
    bpd_images: int = _f(64, min=0)
    pr_neighbourhood: int = _f(3, min=1)
    inception_weights: str = _f("")
    inception_sha256: str = _f("")


@dataclass(frozen=True)
class ReportParams:
    top_k: int = _f(8, min=1)


@dataclass(frozen=True)
class Params:
    data: DataParams = field(default_factory=DataParams)
    model: ModelParams = field(default_factory=ModelParams)
    diffusion: DiffusionParams = field(default_factory=DiffusionParams)
    train: TrainParams = field(default_factory=TrainParams)
    introspect: IntrospectParams = field(default_factory=IntrospectParams)
    sample: SampleParams = field(default_factory=SampleParams)
    evaluator: EvaluatorParams = field(default_factory=EvaluatorParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    report: ReportParams = field(default_factory=ReportParams)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, e.g. to tie a checkpoint to what it was trained with."""
        d = self.to_dict()
        blob = json.dumps({s: d[s] for s in sections}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- validation -------------------------------------------------------------------------------


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) in (list, typing.List):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _coerce(value: Any, tp, path: str):
    """Checks `value` against the annotation `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, path)
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ParamsError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML reads `2e-4` (no dot) as a string: accept it, since users write it that way.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ParamsError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{path}: expected a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ParamsError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ParamsError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp} at {path}")


def _check_range(value, meta: dict, path: str) -> None:
    if value is None:
        return
    items = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(path, value)]
    for path, v in items:
        choices = meta.get("choices")
        if choices is not None and v not in choices:
            allowed = " | ".join(map(str, choices))
            raise ParamsError(f"{path}: {v!r} is not one of {allowed}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (v < lo or (meta.get("min_exclusive") and v == lo)):
            op = ">" if meta.get("min_exclusive") else ">="
            raise ParamsError(f"{path}: must be {op} {lo}, got {v!r}")
        if hi is not None and v > hi:
            raise ParamsError(f"{path}: must be <= {hi}, got {v!r}")


def _build(cls, raw: Any, path: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path or 'params'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ParamsError(f"{where}: unknown key; allowed keys{' in ' + path if path else ''}: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        key_path = f"{path}.{name}" if path else name
        if name not in raw:
            continue  # the dataclass default applies
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, raw[name], key_path)
            continue
        value = _coerce(raw[name], tp, key_path)
        _check_range(value, f.metadata, key_path)
        kwargs[name] = value
    obj = cls(**kwargs)
    _check_cross_field(obj, path)
    return obj


def _check_cross_field(obj, path: str) -> None:
    """Constraints that involve more than one key."""
    if isinstance(obj, TrainParams):
        if not obj.ema_rates:
            raise ParamsError(f"{path}.ema_rates: give at least one EMA rate, e.g. [0.9999]")
        for i, r in enumerate(obj.ema_rates):
            if not 0.0 < r < 1.0:
                raise ParamsError(f"{path}.ema_rates[{i}]: must lie in (0, 1), got {r!r}")
    if isinstance(obj, ModelParams):
        if obj.channel_mult is not None and not obj.channel_mult:
            raise ParamsError(f"{path}.channel_mult: give positive integers, e.g. [1, 2, 2, 2]")
    if isinstance(obj, IntrospectParams) and obj.dump_steps and not obj.dump_modules:
        raise ParamsError(f"{path}.dump_steps: nothing is dumped without {path}.dump_modules; name the modules "
                          "to dump, e.g. [\"out\"], or set dump_steps: []")
    if isinstance(obj, Params):
        # Introspection steps count completed updates, 1..train.steps; a later one would never be recorded.
        for key in ("steps", "dump_steps"):
            for i, st in enumerate(getattr(obj.introspect, key)):
                if st > obj.train.steps:
                    raise ParamsError(f"introspect.{key}[{i}]: step {st} is after the last step (train.steps: "
                                      f"{obj.train.steps}); steps count completed updates, 1..train.steps")
        # The respacer itself decides (one rule, not a copy): any string it cannot apply to T steps.
        try:
            space_timesteps(obj.diffusion.timesteps, obj.sample.respacing)
        except ValueError as e:
            raise ParamsError(f"sample.respacing: {e} (with diffusion.timesteps: {obj.diffusion.timesteps})") from None


def from_dict(raw: Any) -> Params:
    return _build(Params, raw, "")


def load(path: str | Path = "params.yaml") -> Params:
    """Loads and validates params.yaml; raises ParamsError with a one-line message."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: file not found; run from the project root or pass --params PATH")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ParamsError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:
        # Refused, not warned about: an emptied file (a bad save, `>` for `>>`) would otherwise train
        # hours of a different experiment on the defaults, and a warning scrolls away in DVC/SLURM logs.
        raise ParamsError(f"{path}: the file is empty (no keys); if that is an accident, restore it "
                          f"(`git checkout -- {path}`); to run on every default, write {{}} in it "
                          "(`ddpmrepro info --defaults` prints them)")
    return from_dict(raw)


def save_resolved(params: Params, path: str | Path, sections: typing.Iterable[str] | None = None) -> None:
    """Writes the resolved params (all, or some sections) beside an output."""
    d = params.to_dict()
    if sections is not None:
        d = {s: d[s] for s in sections}
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


__all__ = [
    "Params", "ParamsError", "DataParams", "ModelParams", "DiffusionParams", "TrainParams",
    "IntrospectParams", "SampleParams", "EvaluatorParams", "EvaluateParams", "ReportParams",
    "load", "from_dict", "save_resolved",
]
