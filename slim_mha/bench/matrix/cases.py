"""The benchmark matrix: what one case is, and which cases the quick and full runs measure."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "AUTOCAST",
    "Case",
    "DTYPES",
    "MASKED_SHAPES",
    "MASKINGS",
    "MODES",
    "SET_SHAPE",
    "TARGET_SHAPES",
    "build_matrix",
    "parse_shape",
]

# The modules' dtype per --dtype name. "bf16-autocast": fp32 modules and inputs, each call under
# torch.autocast(bfloat16), as mixed-precision training and inference run them.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-autocast": torch.float32}
AUTOCAST = {"bf16-autocast": torch.bfloat16}

# inference: eval() and torch.inference_mode(), so stock takes its native fast path where eligible.
# train: train() forward + backward. train-equivariance: the same with slim's check switched on.
MODES = ("inference", "train", "train-equivariance")
ATTENTIONS = ("self", "cross")

# (batch, seq_len, embed_dim, num_heads) named by the project's CPU targets.
TARGET_SHAPES = ((8, 128, 256, 8), (4, 512, 512, 8))
# A set or point-cloud transformer's size (a batch of small sets, narrow tokens), where a call takes
# a tenth of a millisecond and Python around the kernels weighs most.
SET_SHAPE = (16, 64, 64, 4)
# Self-attention with a padding mask (sets of two sizes in one batch): the smallest call users run,
# where stock's kernel with its mask is hard to beat, and the first target shape.
MASKED_SHAPES = ((2, 16, 64, 4), TARGET_SHAPES[0])
# What a case passes as masks (contenders.case_masks, boolean, as stock's fast path takes them): a key
# padding mask with the last quarter of the keys padded in every other batch row (sets of two sizes),
# a causal mask, or both.
MASKINGS = ("none", "padding", "causal", "both")

# The sweeps behind the speed-up plot. Batch follows the sequence length so that every case holds
# about the same number of tokens: short sequences are not drowned in overhead, long ones stay
# affordable on a 2-core CPU.
_CPU_SEQ_LENS = (64, 128, 256, 512, 1024)
_CPU_WIDTHS = ((256, 8), (512, 8), (1024, 16))
_CPU_TOKENS = 2048
_CUDA_SEQ_LENS = (512, 1024, 2048, 4096)
_CUDA_WIDTHS = ((768, 12), (1024, 16))
_CUDA_TOKENS = 16384


@dataclass(frozen=True)
class Case:
    """One benchmark configuration; every contender runs it on the same weights and inputs.

    Cross-attention reads a memory of ``seq_len`` tokens passed as both key and value (the
    encoder-decoder pattern), so its cost is comparable with self-attention of the same length.
    """

    batch: int
    seq_len: int
    embed_dim: int
    num_heads: int
    attention: str  # "self" | "cross"
    need_weights: bool
    mode: str  # one of MODES
    dtype: str  # one of DTYPES
    masks: str = "none"  # one of MASKINGS (self-attention only)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_len, self.embed_dim, self.num_heads)

    @property
    def is_target(self) -> bool:
        return self.shape in TARGET_SHAPES

    @property
    def trains(self) -> bool:
        return self.mode != "inference"

    @property
    def name(self) -> str:
        weights = "w" if self.need_weights else "-"
        masked = "" if self.masks == "none" else f" {self.masks}"
        return (
            f"{self.mode:<18} {self.attention:<5} {weights} "
            f"B={self.batch:<3} L={self.seq_len:<4} E={self.embed_dim:<4} H={self.num_heads:<2} {self.dtype}{masked}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"8x128x256x8"`` -> ``(batch, seq_len, embed_dim, num_heads)``; raises ``ValueError``."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) <= 0:
        raise ValueError(f"shape {text!r} must be four positive integers BxLxExH, e.g. 8x128x256x8")
    batch, seq_len, embed_dim, num_heads = shape
    if embed_dim % num_heads:
        raise ValueError(f"shape {text!r}: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
    return batch, seq_len, embed_dim, num_heads


def _sweep(seq_lens, widths, tokens) -> list[tuple[int, int, int, int]]:
    return [(max(1, tokens // length), length, width, heads) for (width, heads) in widths for length in seq_lens]


def _default_shapes(device: str, full: bool) -> list[tuple[int, int, int, int]]:
    if device == "cuda":
        return _sweep(_CUDA_SEQ_LENS, _CUDA_WIDTHS, _CUDA_TOKENS)
    if full:
        return list(TARGET_SHAPES) + _sweep(_CPU_SEQ_LENS, _CPU_WIDTHS, _CPU_TOKENS)
    return list(TARGET_SHAPES)


def _quick_cpu_cases(dtype: str) -> list[Case]:
    """About a minute on a 2-core CPU: the targets in every mode, cross-attention, a short length sweep."""
    cases = [
        Case(*shape, "self", need_weights, mode, dtype)
        for shape in TARGET_SHAPES
        for mode in ("inference", "train")
        for need_weights in (False, True)
    ]
    small = TARGET_SHAPES[0]
    cases += [Case(*small, "cross", False, mode, dtype) for mode in ("inference", "train")]
    cases.append(Case(*small, "self", False, "train-equivariance", dtype))
    cases += [Case(batch, length, 256, 8, "self", False, "inference", dtype) for batch, length in ((16, 64), (4, 256))]
    cases += [Case(*SET_SHAPE, "self", False, mode, dtype) for mode in ("inference", "train")]
    cases += [
        Case(*shape, "self", need_weights, mode, dtype, "padding")
        for shape in MASKED_SHAPES
        for mode in ("inference", "train")
        for need_weights in (False, True)
    ]
    return cases


def _quick_cuda_cases(dtypes) -> list[Case]:
    """The CUDA matrix: both half dtypes, L 512-4096, two widths, train and inference, with and without weights."""
    cases = [
        Case(*shape, "self", need_weights, mode, dtype)
        for dtype in dtypes
        for shape in _sweep(_CUDA_SEQ_LENS, _CUDA_WIDTHS, _CUDA_TOKENS)
        for mode in ("inference", "train")
        for need_weights in (False, True)
    ]
    widest = (_CUDA_TOKENS // 1024, 1024, 1024, 16)
    cases += [Case(*widest, "cross", False, mode, dtypes[0]) for mode in ("inference", "train")]
    cases.append(Case(*widest, "self", False, "train-equivariance", dtypes[0]))
    return cases


def build_matrix(
    *,
    device: str,
    dtypes: list[str],
    full: bool = False,
    shapes: list[tuple[int, int, int, int]] | None = None,
    seq_lens: list[int] | None = None,
    modes: list[str] | None = None,
    attentions: list[str] | None = None,
    need_weights: list[bool] | None = None,
    masks: list[str] | None = None,
) -> list[Case]:
    """The cases to run, in order.

    With no selection at all the quick matrix for the device is returned (``full`` gives every
    combination instead). Any explicit selection (shapes, lengths, modes, attentions, weights or
    masks) builds the full product of the chosen values, the others taking their defaults; masks
    apply to self-attention alone.
    """
    selected = any(option is not None for option in (shapes, seq_lens, modes, attentions, need_weights, masks))
    if not full and not selected:
        return _quick_cuda_cases(dtypes) if device == "cuda" else _quick_cpu_cases(dtypes[0])

    base_shapes = shapes if shapes is not None else _default_shapes(device, full)
    if seq_lens is not None:
        base_shapes = [(batch, length, width, heads) for (batch, _, width, heads) in base_shapes for length in seq_lens]
    base_shapes = list(dict.fromkeys(base_shapes))  # keep order, drop repeats
    product = itertools.product(
        dtypes,
        base_shapes,
        modes or MODES,
        attentions or ATTENTIONS,
        need_weights if need_weights is not None else (False, True),
        masks or ("none",),
    )
    return [
        Case(*shape, attention, weights, mode, dtype, masking)
        for dtype, shape, mode, attention, weights, masking in product
        if masking == "none" or attention == "self"
    ]
