"""Finding the attention modules in a checkpoint by their parameter groups, and checking their shapes.

A module is a key prefix ``P`` with ``P.in_proj_weight`` (or ``P.q_proj_weight``, ``P.k_proj_weight``
and ``P.v_proj_weight``) and ``P.out_proj.weight``, plus whichever biases its configuration has, in
the stock layout (``in_proj_bias``) or the slim one (``q_proj_bias``, ``v_proj_bias``, ``k_proj_bias``).
Any tensor named like one of these parameters must belong to a group that fits ``nn.MultiheadAttention``
exactly; otherwise the checkpoint is refused, never changed by a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._records import FLOAT_DTYPES, Checkpoint, TensorRecord
from .report import shown

# Names that only attention modules use: any of them starts a group that must fit.
_ANCHORS = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "q_proj_bias",
    "k_proj_bias",
    "v_proj_bias",
    "bias_k",
    "bias_v",
)
# Common in other models too: they join a group but do not start one.
_MEMBERS = ("out_proj.weight", "out_proj.bias")
_ORDER = _ANCHORS + _MEMBERS  # weights, biases, appended tokens, output: stock's declaration order
_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_SLIM_BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")
_LAST_PARTS = {local.rpartition(".")[2] for local in _ANCHORS + _MEMBERS}


@dataclass(eq=False)
class AttentionGroup:
    """The tensors of one attention module, by local name (``"in_proj_bias"``, ``"out_proj.weight"``...)."""

    prefix: str  # with its trailing dot; "" for a checkpoint of a bare module
    records: dict[str, TensorRecord]
    embed_dim: int
    kdim: int
    vdim: int

    @property
    def name(self) -> str:
        return self.prefix[:-1] if self.prefix else "<root>"

    def __contains__(self, local: str) -> bool:
        return local in self.records

    def sorted_records(self) -> list[tuple[str, TensorRecord]]:
        """The tensors in the order stock declares them: weights, biases, appended tokens, output."""
        return sorted(self.records.items(), key=lambda item: _ORDER.index(item[0]))

    def key(self, local: str) -> str:
        return self.prefix + local

    def where(self, local: str) -> str:
        """``'P.local' in FILE``, for error messages (control characters escaped)."""
        record = self.records.get(local) or next(iter(self.records.values()))
        return f"'{shown(self.key(local))}' in {shown(record.shard.path)}"

    @property
    def has_bias(self) -> bool:
        return "in_proj_bias" in self or "q_proj_bias" in self

    @property
    def has_bias_kv(self) -> bool:
        return "bias_k" in self

    @property
    def is_slim(self) -> bool:
        return any(name in self for name in _SLIM_BIASES)

    @property
    def layout(self) -> str:
        if not self.has_bias:
            return "no input bias"
        if "in_proj_bias" in self:
            return "stock"
        return "slim" if "v_proj_bias" in self else "slim (value bias folded)"

    @property
    def dtype(self) -> str:
        names = sorted({record.dtype for record in self.records.values()})
        return "/".join(str(FLOAT_DTYPES[name]).removeprefix("torch.") for name in names)


def find_attention_modules(checkpoint: Checkpoint) -> list[AttentionGroup]:
    """Every attention module in the checkpoint, in key order, each with checked shapes.

    Raises:
        ValueError: naming the file and key, when a tensor named like an attention parameter belongs
            to a group that does not fit ``nn.MultiheadAttention``.
    """
    groups: dict[str, dict[str, TensorRecord]] = {}
    for key, record in checkpoint.records.items():
        if key.rpartition(".")[2] not in _LAST_PARTS:
            continue  # most tensors of a large model: one set lookup instead of a dozen suffix tests
        for local in _ANCHORS + _MEMBERS:
            if key == local or key.endswith("." + local):
                groups.setdefault(key[: len(key) - len(local)], {})[local] = record
                break
    modules = []
    for prefix in sorted(groups):
        records = groups[prefix]
        if any(local in records for local in _ANCHORS):
            modules.append(_check_group(prefix, records))
    return modules


def _check_group(prefix: str, records: dict[str, TensorRecord]) -> AttentionGroup:
    def fail(local: str, problem: str) -> ValueError:
        record = records.get(local) or records[next(name for name in _ANCHORS if name in records)]
        return ValueError(
            f"{shown(record.shard.path)}: '{shown(prefix + local)}' {shown(problem)}; the tensors under "
            f"'{shown(prefix)}' do not fit nn.MultiheadAttention, so nothing was changed: fix or rename them"
        )

    _check_layout(prefix, records, fail)
    embed_dim, kdim, vdim = _check_shapes(prefix, records, fail)
    _check_biases(prefix, records, fail)
    return AttentionGroup(prefix, records, embed_dim, kdim, vdim)


_Fail = Callable[[str, str], ValueError]  # the error naming a tensor of the group, and its problem


def _check_layout(prefix: str, records: dict[str, TensorRecord], fail: _Fail) -> None:
    """One of stock's two layouts of the input projection, and the output projection beside it."""
    separate = [name for name in _SEPARATE if name in records]
    if "in_proj_weight" in records and separate:
        raise fail(separate[0], "is present together with in_proj_weight (stock has one or the other)")
    if "in_proj_weight" not in records and len(separate) != 3:
        if not separate:
            anchor = next(name for name in _ANCHORS if name in records)
            raise fail(anchor, "is named like an attention parameter but has no in_proj_weight beside it")
        missing = next(name for name in _SEPARATE if name not in records)
        raise fail(separate[0], f"is present but {prefix}{missing} is missing")
    if "out_proj.weight" not in records:
        anchor = "in_proj_weight" if "in_proj_weight" in records else "q_proj_weight"
        raise fail(anchor, f"has no {prefix}out_proj.weight beside it")


def _check_shapes(prefix: str, records: dict[str, TensorRecord], fail: _Fail) -> tuple[int, int, int]:
    """Float dtypes, and every shape as stock's ``__init__`` makes it: ``embed_dim``, ``kdim``, ``vdim``."""
    for local, record in records.items():
        if record.dtype not in FLOAT_DTYPES:
            raise fail(local, f"has dtype {record.dtype}; attention parameters must be F16, BF16, F32 or F64")
    out_shape = records["out_proj.weight"].shape
    if len(out_shape) != 2 or out_shape[0] != out_shape[1] or out_shape[0] == 0:
        raise fail("out_proj.weight", f"has shape {list(out_shape)}, expected [E, E]")
    embed_dim = out_shape[0]
    if "in_proj_weight" in records:
        kdim = vdim = embed_dim
    else:
        for local in _SEPARATE:
            if len(records[local].shape) != 2:
                raise fail(local, f"has shape {list(records[local].shape)}, expected a 2-D [{embed_dim}, dim]")
        kdim, vdim = records["k_proj_weight"].shape[1], records["v_proj_weight"].shape[1]

    expected = {
        "in_proj_weight": [3 * embed_dim, embed_dim],
        "q_proj_weight": [embed_dim, embed_dim],
        "k_proj_weight": [embed_dim, kdim],
        "v_proj_weight": [embed_dim, vdim],
        "in_proj_bias": [3 * embed_dim],
        "q_proj_bias": [embed_dim],
        "k_proj_bias": [embed_dim],
        "v_proj_bias": [embed_dim],
        "bias_k": [1, 1, embed_dim],
        "bias_v": [1, 1, embed_dim],
        "out_proj.bias": [embed_dim],
    }
    for local, shape in expected.items():
        if local in records and list(records[local].shape) != shape:
            raise fail(
                local,
                f"has shape {list(records[local].shape)}, expected {shape} for embed_dim={embed_dim} "
                f"(from {prefix}out_proj.weight)",
            )
    return embed_dim, kdim, vdim


def _check_biases(prefix: str, records: dict[str, TensorRecord], fail: _Fail) -> None:
    """The biases of one layout (stock's or the key-bias-free one), all of them or none."""
    slim = [name for name in _SLIM_BIASES if name in records]
    if "in_proj_bias" in records and slim:
        raise fail(slim[0], "is present together with in_proj_bias (mixes the stock and slim layouts)")
    if slim and "q_proj_bias" not in records:
        raise fail(slim[0], f"is present but {prefix}q_proj_bias is missing")
    if ("bias_k" in records) != ("bias_v" in records):
        present, absent = ("bias_k", "bias_v") if "bias_k" in records else ("bias_v", "bias_k")
        raise fail(present, f"is present but {prefix}{absent} is missing (add_bias_kv sets both)")
    has_bias = "in_proj_bias" in records or "q_proj_bias" in records
    if has_bias != ("out_proj.bias" in records):
        if has_bias:
            raise fail("out_proj.weight", f"has input biases but no {prefix}out_proj.bias (bias=True sets both)")
        raise fail("out_proj.bias", "is present without input biases (bias=False drops both)")
