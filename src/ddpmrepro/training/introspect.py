"""Gradient introspection: parameter-gradient norms, activation-gradient statistics, parquet tables.

Three pieces, all driven from the training loop (the model knows nothing of them):

* `ParamGradRecorder`: per-parameter L2 norms of `p.grad` (after backward, i.e. after DDP's
  all-reduce, and after `scaler.unscale_`, before clipping), parameter norms, and the true update
  ratio ||p_new - p_old|| / ||p_old||. One `_foreach_norm` per list, one host copy per step.
* `ActivationGradRecorder`: forward hooks registered once; when armed they put tensor hooks on the
  outputs (and, optionally, the first tensor input) of the selected modules. Each hook reduces the
  gradient on the device to (sum, sum of squares, nonzero count, max|g|) and optionally a histogram
  of log10|g|; nothing is kept between steps except those few numbers.
* `TableWriter` (in `ddpmrepro/tables.py`, re-exported here): rank 0 only; fixed-schema parquet
  tables written in chunks, a TSV for `dvc plots`, safetensors dumps; a resumed run drops the rows
  of steps it is about to redo.

See docs/INTROSPECTION.md for the semantics of every column.
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

# The tables' format lives below training, where the report stage reads it too; re-exported here
# because the loop (and the tests) know the writer as `introspect.TableWriter`.
from ..tables import (ACT_GRADS_SCHEMA, PARAM_GRADS_SCHEMA, SCHEMAS, STEPS_SCHEMA, TSV_COLUMNS,  # noqa: F401
                      TableWriter, read_table)

log = logging.getLogger(__name__)

# --- selection --------------------------------------------------------------------------------


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def select_names(names: Iterable[str], patterns: Sequence[str], *, outermost: bool = False, what: str = "name") -> list[str]:
    """Names (in their original order) matched by any pattern: an fnmatch glob or `re:REGEX` (full match).

    With `outermost`, a name matched only by globs is dropped when a dotted ancestor is matched by a
    glob too, so `input_blocks.*` means each input block rather than every submodule inside them;
    a `re:` pattern always selects exactly the names it matches.
    Raises ValueError naming the first pattern that matches nothing.
    """
    names = list(names)
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"introspect pattern {p!r} is not a valid regular expression: {e}") from None
        if not any(_matches(n, p) for n in names):
            sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"introspect pattern {p!r} matches no {what}; {what}s look like: {sample}")
    by_glob = {n for n in names if any(_matches(n, p) for p in patterns if not p.startswith("re:"))}
    by_re = {n for n in names if any(_matches(n, p) for p in patterns if p.startswith("re:"))}

    def covered(n: str) -> bool:
        parts = n.split(".")
        return any(".".join(parts[:i]) in by_glob for i in range(1, len(parts)))

    return [n for n in names if n in by_re or (n in by_glob and not (outermost and covered(n)))]


def is_record_step(step: int, every: int, steps: Iterable[int] = (), last: int | None = None) -> bool:
    """True when `step` is recorded: a multiple of `every` (if > 0), the `last` step (if every > 0,
    as dvclive logs it), or listed in `steps`.

    Steps count completed updates, as dvclive and checkpoints do: step N is the state after the
    N-th optimizer update (its gradients, before that update is applied), so the first is 1.
    """
    return (every > 0 and (step % every == 0 or step == last)) or step in set(steps)


def _shape_str(shape: torch.Size) -> str:
    return "x".join(str(s) for s in shape)


# --- parameter gradients ----------------------------------------------------------------------


class ParamGradRecorder:
    """Per-parameter gradient norms, parameter norms and update ratios.

    Call `capture(step)` after the last backward and `scaler.unscale_` and before clipping, then
    `finish(...)` after the optimizer step. Under DDP, `p.grad` is already the all-reduced mean, so
    rank 0 alone may call both (no collective is involved).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], patterns: Sequence[str], *, update_ratio: bool = True):
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        keep = set(select_names([n for n, _ in named], patterns, what="parameter")) if patterns else set()
        self.names = [n for n, _ in named if n in keep]
        self.params = [p for n, p in named if n in keep]
        self.update_ratio = update_ratio
        self._pending: dict | None = None

    @torch.no_grad()
    def capture(self, step: int) -> None:
        """Grad and param norms on the device (no host sync); snapshots params for the update ratio."""
        if not self.params:
            self._pending = {"step": step, "norms": None, "has_grad": [], "snapshot": None}
            return
        has_grad = [p.grad is not None for p in self.params]
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        gn = torch.stack(torch._foreach_norm(grads)).float() if grads else None  # stack promotes mixed dtypes
        values = [p.detach() for p in self.params]
        pn = torch.stack(torch._foreach_norm(values)).float()
        snapshot = torch._foreach_mul(values, 1.0) if self.update_ratio else None
        self._pending = {"step": step, "grad": gn, "param": pn, "has_grad": has_grad, "snapshot": snapshot}

    @torch.no_grad()
    def finish(self, *, total_norm: float | torch.Tensor = math.nan, clip_threshold: float = math.nan,
               clipped: bool | None = None, skipped: bool = False, loss_scale: float = 1.0,
               lr: float = math.nan) -> tuple[list[dict], dict]:
        """Rows of the `param_grads` table and the `steps` row, with one host copy.

        `clipped` defaults to total_norm > clip_threshold (when the threshold is > 0).
        """
        if self._pending is None:
            raise RuntimeError("ParamGradRecorder.finish() called without capture()")
        pend, self._pending = self._pending, None
        step = pend["step"]
        n = len(self.params)
        rows: list[dict] = []
        sq_sum = 0.0
        if n:
            parts = [pend["param"]]
            if pend["grad"] is not None:
                parts.append(pend["grad"])
            if pend["snapshot"] is not None:
                torch._foreach_sub_(pend["snapshot"], [p.detach() for p in self.params])
                parts.append(torch.stack(torch._foreach_norm(pend["snapshot"])).float())
            host = torch.cat(parts).double().cpu().tolist()  # the one host copy
            pnorm = host[:n]
            gnorm_iter = iter(host[n:n + sum(pend["has_grad"])])
            gnorm = [next(gnorm_iter) if h else math.nan for h in pend["has_grad"]]
            unorm = host[-n:] if pend["snapshot"] is not None else [math.nan] * n
            for name, p, g, pn, un in zip(self.names, self.params, gnorm, pnorm, unorm):
                rows.append({"step": step, "name": name, "shape": _shape_str(p.shape), "numel": p.numel(),
                             "grad_norm": g, "param_norm": pn,
                             "update_ratio": un / pn if pn > 0 else math.nan})
                if not math.isnan(g):
                    sq_sum += g * g
        total = float(total_norm)
        thr = float(clip_threshold)
        if clipped is None:
            clipped = bool(thr > 0 and total > thr)
        summary = {"step": step, "total_grad_norm": total, "selected_grad_norm": math.sqrt(sq_sum),
                   "clip_threshold": thr, "clipped": bool(clipped), "skipped": bool(skipped),
                   "loss_scale": float(loss_scale), "lr": float(lr)}
        return rows, summary


# --- activation gradients ---------------------------------------------------------------------

_K = 5  # stats per slot: sum, sum of squares, nonzero count, numel, calls (all summed); absmax is kept apart


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            if isinstance(v, torch.Tensor):
                return v
    return None


class ActivationGradRecorder:
    """Statistics of the gradients flowing into the outputs (and inputs) of selected modules.

    :param model: the raw module (not the DDP wrapper), so names carry no `module.` prefix.
    :param patterns: globs / `re:` patterns on module names (outermost glob matches, see `select_names`).
    :param inputs: also record the gradient w.r.t. each module's first positional tensor argument,
        through this module only: when armed, a forward pre-hook passes `x.view_as(x)` so that other
        consumers of `x` (e.g. UNet skip connections) do not add into it.
    :param histogram_bins: if > 0, a histogram of log10|g| (after dividing by the loss scale) on
        `hist_range`; values outside it land in the edge bins, exact zeros in the first.
    :param reduction: under torch.distributed with world size W > 1. All values are gradients of the
        loss DDP optimises (the mean of the per-rank losses), i.e. local hook gradients divided by W.
        "global": all-reduce the stats so rows describe the concatenation over ranks (what one process
        would see with the whole global batch); "per_rank": all-gather and emit one row per rank;
        "local": no collective, this rank's own numbers (the only mode where `collect` may be
        called on rank 0 alone). For "global" and "per_rank", every rank must call arm/collect.
    """

    def __init__(self, model: nn.Module, patterns: Sequence[str], *, inputs: bool = True,
                 histogram_bins: int = 0, hist_range: tuple[float, float] = (-14.0, 2.0),
                 dump_steps: Iterable[int] = (), dump_modules: Sequence[str] = (), dump_max_mb: float = 16.0,
                 reduction: str = "global", group=None):
        if reduction not in ("global", "per_rank", "local"):
            raise ValueError(f"reduction must be 'global', 'per_rank' or 'local', got {reduction!r}")
        modules = dict(model.named_modules())
        names = [n for n in modules if n]
        self.names = select_names(names, patterns, outermost=True, what="module") if patterns else []
        self.dump_names = set(select_names(names, dump_modules, outermost=True, what="module")) if dump_modules else set()
        if not self.dump_names <= set(self.names):
            raise ValueError(f"dump modules {sorted(self.dump_names - set(self.names))} are not among the recorded "
                             f"modules; add them to the module patterns")
        self.dump_steps = set(dump_steps)
        self.dump_max_bytes = int(dump_max_mb * 2**20)
        self.inputs = inputs
        self.bins = int(histogram_bins)
        self.hist_lo, self.hist_hi = float(hist_range[0]), float(hist_range[1])
        self.reduction, self.group = reduction, group
        # slot 2*i: output of module i, slot 2*i+1: its input
        self._slots = [(n, t) for n in self.names for t in ("output", "input")]
        self._armed = False
        self._paused = False
        self._step = -1
        self._scale = 1.0
        self._calls: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (slot, stats, hist) this step
        self._numel = [0] * len(self._slots)
        self._dumps: dict[str, torch.Tensor] = {}
        self._dump_bytes = 0
        self._dumping = False
        self._views: dict[int, tuple[torch.Tensor, int]] = {}  # input views between pre- and forward hook
        self._inplace_slots: set[int] = set()
        self._handles = []
        for i, name in enumerate(self.names):
            m = modules[name]
            self._handles.append(m.register_forward_hook(self._make_forward_hook(2 * i)))
            if inputs:
                self._handles.append(m.register_forward_pre_hook(self._make_pre_hook(2 * i + 1)))

    # hooks: forward hooks return None (a returned value would replace the output)
    def _make_forward_hook(self, slot: int):
        def forward_hook(module, args, output):
            view = self._views.pop(slot + 1, None)
            if view is not None and view[0]._version != view[1]:
                # The module wrote into its input in place: the view's hook would not fire reliably.
                self._inplace_slots.add(slot + 1)
                log.warning("%s modifies its input in place; its input gradient is not recorded", self._slots[slot][0])
            if not self._armed or not torch.is_grad_enabled():
                return None
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(self._make_tensor_hook(slot))
            return None
        return forward_hook

    def _make_pre_hook(self, slot: int):
        def pre_hook(module, args):
            if not self._armed or not torch.is_grad_enabled() or not args:
                return None
            x = args[0]
            if not isinstance(x, torch.Tensor) or not x.requires_grad:
                return None
            if slot in self._inplace_slots:
                return None
            x = x.view_as(x)  # a fresh autograd node: its grad is this module's share only
            x.register_hook(self._make_tensor_hook(slot))
            self._views[slot] = (x, x._version)
            return (x, *args[1:])
        return pre_hook

    def _make_tensor_hook(self, slot: int):
        def tensor_hook(grad: torch.Tensor):
            if not self._paused:
                self._accumulate(slot, grad)
            return None
        return tensor_hook

    @contextlib.contextmanager
    def paused(self):
        """Backward passes that are not the training's (the noise-level instrument's extra ones run
        through the same graph) are not recorded: each gradient is recorded once."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @torch.no_grad()
    def _accumulate(self, slot: int, g: torch.Tensor) -> None:
        g = g.detach()
        f32 = torch.float32
        # 4 passes over g, the cheapest found on CPU (vector_norm(ord=inf) is ~10x slower than aminmax)
        mn, mx = torch.aminmax(g)
        stats = torch.stack([
            torch.sum(g, dtype=f32),
            torch.linalg.vector_norm(g, dtype=f32).square(),
            torch.count_nonzero(g).to(f32),
            torch.maximum(mx, -mn).to(f32),
        ])
        hist = None
        if self.bins:
            lg = g.abs().to(f32).log10_().sub_(math.log10(self._scale)).clamp_(self.hist_lo, self.hist_hi)  # a copy: g flows on
            hist = torch.histc(lg, self.bins, self.hist_lo, self.hist_hi)
        self._calls.append((slot, stats, hist))
        self._numel[slot] += g.numel()
        if self._dumping and self._slots[slot][0] in self.dump_names:
            nbytes = g.numel() * 4
            prefix = "/".join(self._slots[slot]) + "/"
            key = prefix + str(sum(k.startswith(prefix) for k in self._dumps))  # module/tensor/call
            if self._dump_bytes + nbytes <= self.dump_max_bytes:
                self._dumps[key] = g.to(f32).div(self._scale).cpu()
                self._dump_bytes += nbytes
            else:
                log.warning("step %d: dump of %s skipped (dump_max_mb reached)", self._step, key)

    # --- per step ------------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self, step: int, loss_scale: float | torch.Tensor = 1.0) -> None:
        """Record the gradients of the next forward/backward passes (all microbatches of `step`).

        `loss_scale`: the GradScaler scale the backward runs with (`scaler.get_scale()`), else 1.
        """
        self._armed, self._step, self._scale = True, step, float(loss_scale)
        self._calls.clear()
        self._numel = [0] * len(self._slots)
        self._dumps, self._dump_bytes = {}, 0
        self._dumping = step in self.dump_steps and bool(self.dump_names)

    def disarm(self) -> None:
        self._armed = False

    def _world(self) -> tuple[int, int]:
        d = torch.distributed
        if d.is_available() and d.is_initialized():
            return d.get_rank(self.group), d.get_world_size(self.group)
        return 0, 1

    @torch.no_grad()
    def collect(self) -> list[dict]:
        """Disarms and returns the rows of the `act_grads` table for the armed step (one host copy).

        With reduction "global" or "per_rank" under a process group this is a collective: call it
        on every rank. Slots that received no gradient (e.g. an input that needs none) give no row.
        """
        self._armed = False
        S = len(self._slots)
        if S == 0:
            return []
        rank, world = self._world()
        collective = world > 1 and self.reduction != "local"
        if self._calls:
            device = self._calls[0][1].device
        else:  # a collective needs a tensor on the group's device even when nothing was recorded
            device = _group_device(self.group) if collective else torch.device("cpu")
        summed = torch.zeros(S, _K + self.bins, dtype=torch.float64, device=device)  # sums | hist
        amax = torch.zeros(S, 1, dtype=torch.float64, device=device)
        summed[:, 3] = torch.tensor(self._numel, dtype=torch.float64, device=device)
        if self._calls:
            idx = torch.tensor([c[0] for c in self._calls], device=device)
            st = torch.stack([c[1] for c in self._calls]).double()  # (calls, 4)
            summed[:, :3].index_add_(0, idx, st[:, :3])
            summed[:, 4].index_add_(0, idx, torch.ones_like(st[:, 0]))
            amax[:, 0].scatter_reduce_(0, idx, st[:, 3], reduce="amax")
            if self.bins:
                summed[:, _K:].index_add_(0, idx, torch.stack([c[2] for c in self._calls]).double())
        self._calls.clear()
        if collective and self.reduction == "global":
            torch.distributed.all_reduce(summed, group=self.group)
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.group)
        packed = torch.cat([summed, amax], dim=1)  # (S, _K + bins + 1)
        if collective and self.reduction == "per_rank":
            gathered = [torch.empty_like(packed) for _ in range(world)]
            torch.distributed.all_gather(gathered, packed, group=self.group)
            packed, ranks = torch.stack(gathered), list(range(world))
        else:
            packed, ranks = packed[None], [-1 if self.reduction == "global" else rank]
        return self._rows(packed.cpu(), ranks, world)  # the one host copy

    def _rows(self, host: torch.Tensor, ranks: list[int], world: int) -> list[dict]:
        # values are grads of (mean over ranks of the local losses) * loss_scale: undo both factors
        div = self._scale * world
        rows = []
        for r, block in zip(ranks, host):
            for slot, (name, tensor) in enumerate(self._slots):
                s, ss, nnz, numel, calls = block[slot, :_K].tolist()
                amax = block[slot, -1].item()
                if calls == 0 or slot in self._inplace_slots:
                    continue
                mean = s / numel / div
                var = max(ss / numel / div**2 - mean * mean, 0.0)
                counts = [int(round(c)) for c in block[slot, _K:_K + self.bins].tolist()]
                rows.append({"step": self._step, "module": name, "tensor": tensor, "reduction": self.reduction,
                             "rank": r, "world_size": world, "calls": int(calls), "numel": int(numel),
                             "l2": math.sqrt(ss) / div, "mean": mean, "std": math.sqrt(var), "absmax": amax / div,
                             "zero_frac": 1.0 - nnz / numel, "hist": counts,
                             "hist_lo": self.hist_lo if self.bins else math.nan,
                             "hist_hi": self.hist_hi if self.bins else math.nan})
        return rows

    def take_dumps(self) -> dict[str, torch.Tensor]:
        """Full gradient tensors recorded at a dump step (this rank's, divided by the loss scale only),
        keyed `module/tensor/call`; empty on other steps. Clears them."""
        dumps, self._dumps, self._dump_bytes = self._dumps, {}, 0
        return dumps

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._armed = False
        self._calls.clear()
        self._dumps = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _group_device(group) -> torch.device:
    backend = torch.distributed.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
