"""Which timesteps a respaced sampler keeps (IDDPM's `space_timesteps`), and what strings are allowed.

Pure Python on purpose, and at the bottom of the package beside params.py: params.py checks
`sample.respacing` against `diffusion.timesteps` with this very function when params.yaml is loaded,
and `model/diffusion.py` and `model/samplers.py` respace with it, so the rule that validates is the
rule that respaces. Here rather than in `model/`, params.py imports nothing above itself: loading
params never imports torch, and a stage that reads params does not depend on (and rerun for) the
model's code. `diffusion.from_params` turns the kept steps into a process.

Published IDDPM numbers were sampled with improved-diffusion's rule, so ours reproduces its output
for every string it accepts, float quirks included (see `_section`). Strings that it would turn
into an empty or partly empty process ("0,0", "ddim0") or reject with a traceback are refused here
with one line saying what is allowed.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

ALLOWED = "'' (every step), 'ddimN', or comma-separated steps per section like '10,15,20'"
_COUNTS = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*", re.ASCII)


def _section(size: int, count: int) -> list[int]:
    """`count` offsets spread evenly over a section of `size` steps, ends included.

    improved-diffusion advances a float cursor by repeated addition of the stride (size-1)/(count-1)
    and takes Python's round() of each position (ties to even). Repeated addition drifts from
    j * stride by a few ulps, which decides exact ties: in a section of 100 steps with 15 kept, the
    8th position is 49.5 exactly but the cursor holds 49.49999999999999, so 49 is kept, not 50.
    We advance the cursor the same way so that every kept step matches.
    """
    stride = 1.0 if count <= 1 else (size - 1) / (count - 1)
    cursor, offsets = 0.0, []
    for _ in range(count):
        offsets.append(round(cursor))
        cursor += stride
    return offsets


def ddim_stride(num_timesteps: int, count: int) -> int:
    """The smallest integer stride i < T with exactly `count` steps in range(0, T, i) (the DDIM
    paper's even striding); ValueError naming the nearest counts that exist when there is none."""
    for stride in range(1, num_timesteps):
        if len(range(0, num_timesteps, stride)) == count:
            return stride
    possible = sorted({math.ceil(num_timesteps / i) for i in range(1, num_timesteps)})
    below = [n for n in possible if n < count]
    above = [n for n in possible if n > count]
    nearest = " or ".join(f"'ddim{n}'" for n in (below[-1:] + above[:1]))
    raise ValueError(f"'ddim{count}': no integer stride takes exactly {count} of {num_timesteps} steps "
                     f"(range(0, {num_timesteps}, i) for some i < {num_timesteps}); nearest possible: {nearest}")


def space_timesteps(num_timesteps: int, section_counts: str | Sequence[int]) -> set[int]:
    """The original timesteps kept by a respaced sampler.

    - "" : every step.
    - "ddimN": range(0, T, i) for the smallest integer stride i giving exactly N steps, as in the
      DDIM paper (improved-diffusion's "ddim" striding).
    - "10,15,20" (or a list of ints): split [0, T) into that many near-equal sections (the first
      T mod k one step longer), take that many evenly spaced steps (see `_section`) from each, ends
      included. Each count must be at least 1 and at most its section's length.

    :param num_timesteps: T of the original process.
    :param section_counts: as above.
    :return: the set of kept original timestep indices.
    :raises ValueError: one line saying why the string cannot respace T steps.
    """
    if isinstance(section_counts, str):
        text = section_counts.strip()
        if text == "":
            return set(range(num_timesteps))
        if text.startswith("ddim"):
            if not text[4:].isascii() or not text[4:].isdigit():
                raise ValueError(f"{section_counts!r} is not 'ddimN' with N a whole number of steps; use {ALLOWED}")
            count = int(text[4:])
            return set(range(0, num_timesteps, ddim_stride(num_timesteps, count)))
        if not _COUNTS.fullmatch(text):
            raise ValueError(f"{section_counts!r} is not {ALLOWED}")
        counts = [int(x) for x in text.split(",")]
    else:
        counts = [int(x) for x in section_counts]
    given = repr(section_counts)
    if len(counts) > num_timesteps:
        raise ValueError(f"{given}: {len(counts)} sections but only {num_timesteps} steps; "
                         f"use at most {num_timesteps} sections")
    size_per, extra = divmod(num_timesteps, len(counts))
    start, kept = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(f"{given}: section {i + 1} of {len(counts)} covers {size} of the {num_timesteps} steps "
                             f"and cannot keep {count}: each count must be between 1 and its section's length")
        kept += [start + offset for offset in _section(size, count)]
        start += size
    return set(kept)


__all__ = ["space_timesteps", "ddim_stride", "ALLOWED"]
