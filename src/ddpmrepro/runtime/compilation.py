"""`train.compile` and `sample.compile`: `torch.compile` of the UNet's repeated blocks (regional
compilation), in place, so that a compiled run keeps the same parameter names, checkpoints,
EMA copies and introspection hooks as an eager one.

Why the blocks and not the whole network:
- **Cold start.** A UNet is a few distinct blocks repeated: Dynamo traces `ResBlock.forward` and
  `AttentionBlock.forward` once per distinct shape and configuration (the `tiny` preset has 5 of
  them for 18 blocks, as docs/TRAINING.md says and tests/test_docs.py checks), and a second process
  finds the compiled kernels in Inductor's on-disk caches (`cache_dir`), instead of tracing one
  graph of every layer each time.
- **Hooks stay eager.** The activation-gradient recorder hooks `input_blocks.*`, `middle_block`,
  `output_blocks.*` and `out` (the blocks' containers). Only each block's `forward` is compiled,
  so those hooks, and a hook on a block itself, run as in eager mode, on every recorded step, with
  no graph break and no recompilation when the recorder arms and disarms. A block that contains a
  hooked module (a pattern reaching inside it) stays eager: Dynamo would trace that hook into the
  graph, and one added after compilation would be ignored.

Randomness: `fallback_random` makes compiled dropout draw from torch's generator as eager does, so
a compiled step draws the same masks from the same per-step seed (loop.step_seed), and a compiled
run agrees with the eager run within float tolerance instead of drawing other masks.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

# Beside the checkpoints (git- and DVC-ignored), relative to the project: `ddpmrepro train --checkpoints
# DIR` uses DIR/inductor-cache, and `sample` this one.
DEFAULT_CACHE_DIR = Path("checkpoints") / "inductor-cache"
log = logging.getLogger(__name__)


class Compiler:
    """A stage's `compile` param: checked when built (call it before anything is written), applied
    by calling it on the model once the model is built (and after anything that copies it)."""

    def __init__(self, mode: str, device: torch.device, *, cache_dir: Path, key: str):
        self.mode = mode
        if mode != "none":
            check_leaving_nothing(mode, device, key, cache_dir)

    def __call__(self, model: nn.Module, *, eager_inside: set[str] = frozenset()) -> list[str]:
        """Compiles `model`'s blocks in place ("blocks"); returns their names ([] for "none")."""
        if self.mode == "none":
            return []
        blocks = compile_blocks(model, eager_inside=eager_inside)
        if os.environ.get("RANK", "0") == "0":
            log.info("%d blocks compile on their first call (Inductor's cache: %s)", len(blocks),
                     os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return blocks


class CompileUnavailable(RuntimeError):
    """torch.compile cannot work here (no compiler, an unsupported device or Python)."""


def check_available(mode: str, device: torch.device, key: str) -> None:
    """Raises CompileUnavailable, one line naming `key` and how to turn it off, when Inductor
    cannot compile for `device` on this machine. Cheap: run before anything is written."""
    if mode == "none":
        return
    off = f"or set {key}: none"
    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnavailable(f"{key}: {mode!r} needs torch.compile, which this PyTorch does not support on "
                                 f"Python {sys.version_info.major}.{sys.version_info.minor}; {off}")
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()  # what Inductor itself runs: `$CXX --version` or `g++ --version`
        except exc.InvalidCxxCompiler:
            wanted = os.environ.get("CXX", "g++")
            raise CompileUnavailable(f"{key}: {mode!r} needs a C++ compiler for Inductor's CPU kernels and "
                                     f"{wanted!r} was not found or does not run; install one (Debian: apt-get install "
                                     f"g++) or point $CXX at it, {off}") from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileUnavailable(f"{key}: {mode!r} needs Triton for Inductor's GPU kernels, and it is not "
                                     f"usable here (pip install triton; compute capability 7.0 or newer); {off}")
        if not (shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")):
            raise CompileUnavailable(f"{key}: {mode!r} needs a C compiler for Triton's launcher and none was found "
                                     f"(Debian: apt-get install gcc, or set $CC), {off}")
    else:
        raise CompileUnavailable(f"{key}: {mode!r} is not supported on device {device.type!r}; {off}")


def check_leaving_nothing(mode: str, device: torch.device, key: str, cache_dir: Path) -> None:
    """`check_available` under Inductor's cache directory `cache_dir` ($TORCHINDUCTOR_CACHE_DIR
    first), leaving no folder behind when it raises.

    The check imports Dynamo, and that import creates the cache directory (and its missing parents)
    and fixes it for the process: so the directory is chosen before the check, and the folders the
    import created are removed again (if still empty) when compilation cannot work here, because a
    stage refused at this point writes nothing."""
    target = use_cache_dir(cache_dir).absolute()
    created = [d for d in (target, *target.parents) if not d.exists()]  # deepest first
    try:
        check_available(mode, device, key)
    except CompileUnavailable:
        for folder in created:
            try:
                folder.rmdir()  # empty only: another process may have put its files there meanwhile
            except OSError:
                break
        raise


def use_cache_dir(directory: Path) -> Path:
    """Inductor's on-disk caches (compiled graphs, kernels, autotuning) go to `directory` unless
    $TORCHINDUCTOR_CACHE_DIR says otherwise, so a rerun or the next `dvc exp run` starts warm. Keep
    it outside DVC's outputs (checkpoints/ is git- and DVC-ignored): it is a cache, not a result.

    Call it before anything asks Inductor for its cache directory: the first such call (importing
    torch._dynamo makes one, and `check_available` imports it) fixes it for the process, setting the
    variable to /tmp/torchinductor_$USER, and creates the folder."""
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(directory).resolve())))


def compile_blocks(model: nn.Module, *, eager_inside: set[str] = frozenset()) -> list[str]:
    """Compiles, in place, the `forward` of every block of `model` of a type it lists in
    `model.repeated_blocks` (the UNet's residual and attention blocks) that contains none of the
    modules named in `eager_inside` (hooked ones); returns the names of the blocks compiled.
    Idempotent: a block compiled before is left as it is."""
    kinds = getattr(model, "repeated_blocks", None)
    if not kinds:
        raise TypeError(f"{type(model).__name__} does not say which blocks repeat (`repeated_blocks`)")
    # Each distinct block (class, shape, configuration) is one cache entry of the same code object:
    # a wide preset has more of them than the default limit of 8, past which Dynamo falls back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._inductor.config.fallback_random = True  # eager's generator: the same dropout masks
    # The noise-level instrument runs extra backward passes through a step's graph (retain_graph):
    # a backward compiled to reuse ("donate") its saved buffers cannot run twice.
    torch._functorch.config.donated_buffer = False
    compiled = []
    for name, module in model.named_modules():
        if not isinstance(module, kinds):
            continue
        if any(inner.startswith(name + ".") for inner in eager_inside):
            continue
        if "forward" not in vars(module):  # the instance's own attribute: compiled before
            # The bound method: nn.Module.__call__ runs the module's hooks around it, eagerly.
            module.forward = torch.compile(module.forward, dynamic=False)
        compiled.append(name)
    return compiled
