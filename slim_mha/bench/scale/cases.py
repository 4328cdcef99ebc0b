"""``python -m slim_mha.bench scale``: how time and memory grow with the number of tokens.

Set and point-cloud transformers attend over tens of thousands of tokens. This sweep runs stock
``nn.MultiheadAttention`` and slim at token counts N from 1k to 100k (to 1M on a GPU), for a
point-cloud shape (E=64, H=4) and a transformer shape (E=512, H=8), with and without a key padding
mask, in inference and training, always with ``need_weights=False``.

* **One process per case.** Each (contender, shape, mode, mask, N) runs in a fresh child process, so
  an out-of-memory failure is recorded as "OOM at N" and the sweep goes on. On CPU the child caps
  its own address space (``RLIMIT_AS``, default half the memory available when the sweep starts),
  so a contender that needs more fails at once with the allocator's error instead of swapping or
  waking the kernel's OOM killer on a shared machine. A child that is killed or runs past its
  timeout is recorded as such.
* **Time** is the median of one to five calls (forward in inference, forward and backward in
  training), repeated until a second has passed. **Memory** is the child's own peak: on CPU the
  peak resident set size above the resident size just before the calls (the high-water mark is
  reset there through ``/proc/self/clear_refs``), on CUDA ``max_memory_allocated`` above what was
  allocated before. Inputs, weights and the runtime are in the baseline; what remains is what the
  call needs.
* **Order and budgets.** The first configuration (point-cloud inference without a mask, by default)
  runs over every N first, then the others in order of N. A contender's curve stops after it
  fails, after a call takes longer than the case budget, or when the call at the next N is
  extrapolated (from the slope of its last two points) to take longer, unless it is extrapolated
  to need more memory than the cap (it then fails at once, which is the point to record); the sweep
  starts no case once its total budget is spent. Every case not run is recorded with the reason.

Output: JSON, a Markdown report (tables, the largest N each contender handled, memory at a common
N) and a log-log plot of time and memory against N.

The sweep is split as the rest of the benchmark is: the cases and settings here, the child's
measurement in ``child`` (time, peak and cap), the sweep's order and budgets in ``sweep``, the tables
and the plot in ``report`` and the command line in ``command``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BUDGETS", "CONTENDERS", "DTYPES", "MODES", "SHAPES", "TOKENS", "Series", "Settings", "build_series"]

SHAPES = {"point-cloud": (64, 4), "transformer": (512, 8)}  # name -> (embed_dim, num_heads)
MODES = ("inference", "train")
CONTENDERS = ("stock", "slim")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = {
    "cpu": (1024, 8192, 32768, 100_000),
    "cuda": (1024, 4096, 16384, 65536, 131072, 262144, 524288, 1_000_000),
}
# Per device: (sweep budget, case budget) in seconds. The CPU default keeps the sweep to about five
# minutes on a 2-core machine; the curves it cuts short say where and why.
BUDGETS = {"cpu": (300.0, 30.0), "cuda": (600.0, 60.0)}
PADDED_FRACTION = 8  # with a padding mask, the last N // 8 keys of every sequence are padding
RESULT_MARKER = "SLIM_MHA_SCALE_RESULT "  # the child's result line on stdout starts with this
OOM_MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory")


@dataclass(frozen=True)
class Series:
    """One curve: a contender on one shape, mode and mask, over N."""

    contender: str
    shape: str
    embed_dim: int
    num_heads: int
    mode: str
    padding_mask: bool

    @property
    def name(self) -> str:
        return f"{self.contender} {self.shape} {self.mode}{' +mask' if self.padding_mask else ''}"


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    dtype: str = "fp32"
    batch: int = 1
    budget_s: float = 300.0
    case_budget_s: float = 20.0
    case_timeout_s: float = 120.0
    memory_cap_bytes: int | None = None  # CPU children only; None: no cap
    threads: int | None = None
    seed: int = 0


def build_series(shapes=None, modes=None, padding_masks=None, contenders=None) -> list[Series]:
    """The curves to draw, grouped so that stock and slim of one configuration run side by side."""
    return [
        Series(contender, shape, *SHAPES[shape], mode, masked)
        for shape in shapes or SHAPES
        for mode in modes or MODES
        for masked in (padding_masks if padding_masks is not None else (False, True))
        for contender in contenders or CONTENDERS
    ]
