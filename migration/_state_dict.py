"""The migration of a state dict held in memory: the same plans and arithmetic as the file path.

A training script holds ``model.state_dict()``, not a file. :func:`migrate_state_dict` reads it as the
file path reads a torch pickle (one record per tensor, the tensor itself as its data), plans each
attention module with :func:`._plan.plan_module` and rewrites it with :func:`._plan.migrated_tensors`:
one owner of what each mode does. The result is a new dict; the input and its tensors are never
modified, and every tensor the mode leaves alone is the caller's own object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from torch import Tensor

from ._modules import AttentionGroup, find_attention_modules
from ._plan import migrated_tensors, plan_module
from ._records import DTYPE_NAMES, Checkpoint, Shard, TensorRecord
from ._zero_attn import check_patterns, zero_attn_modules
from .report import with_article

__all__ = ["migrate_state_dict"]

_SOURCE = "<state dict>"


def migrate_state_dict(
    state_dict: Mapping[str, Tensor], mode: str, *, zero_attn: Iterable[str] = (), fold_value_bias: bool = False
) -> dict[str, Tensor]:
    """``state_dict`` with every attention module in ``mode``'s layout (``fold``, ``strip``, ``to-stock``).

    Raises:
        ValueError: naming the key, for a value that is not a tensor, a module that does not fit
            ``nn.MultiheadAttention``, or a conversion that would not be exact.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict must be a mapping of names to tensors (model.state_dict()), got {with_article(type(state_dict).__name__)}"
        )
    shard = Shard(name=_SOURCE, path=Path(_SOURCE), metadata={})
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise ValueError(
                f"state_dict[{key!r}] is {with_article(type(value).__name__)}, not a tensor under a string key: pass a state "
                "dict of tensors, such as model.state_dict()"
            )
        if value.dtype not in DTYPE_NAMES:
            continue  # a dtype no attention parameter has: left as it is
        shard.records[key] = TensorRecord(
            key, DTYPE_NAMES[value.dtype], tuple(value.shape), value.numel() * value.element_size(), shard, tensor=value
        )
    checkpoint = Checkpoint(source=shard.path, kind="torch", shards=[shard])
    groups = find_attention_modules(checkpoint)
    marked = zero_attn_modules(check_patterns(zero_attn), groups, checkpoint)
    result = dict(state_dict)
    for group in groups:
        plan = plan_module(group, mode, zero_attn=group.name in marked, fold_value_bias=fold_value_bias)
        if plan.refusal:
            raise ValueError(f"{plan.refusal}; the state dict was not changed")
        rewritten = migrated_tensors(plan, _reader(group))
        for local in plan.removed:
            result.pop(group.key(local), None)
        result.update({group.key(local): tensor for local, tensor in rewritten.items()})
    return result


def _reader(group: AttentionGroup) -> Callable[[str], Tensor]:
    """``read(local)``: the module's tensor of that local name, from the state dict."""

    def read(local: str) -> Tensor:
        return group.records[local].read()

    return read
