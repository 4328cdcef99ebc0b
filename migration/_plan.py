"""What each mode does to one attention module, decided from its layout; and the arithmetic, done once.

The arithmetic itself is :mod:`slim_mha.bias`, the same code the module's ``load_state_dict`` runs; this
file only decides which of its functions apply and where their results go. Computation is in float64
(every stored float converts to it exactly), and each result is rounded once to the dtype of the tensor
it replaces, so dtypes are kept and folding adds at most one rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from slim_mha.bias import (
    BIAS_NAMES,
    SlimBiases,
    fold_key_bias,
    fold_value_bias_into_output,
    keeps_key_bias,
    unfold_key_bias,
    zero_key_bias,
)

from ._modules import AttentionGroup
from ._records import FLOAT_DTYPES
from .report import option, shown

MODES = ("strip", "fold", "to-stock")
_WIDE = torch.float64


@dataclass(frozen=True)
class ModulePlan:
    """What ``mode`` does to one module.

    ``placed`` maps each new or rewritten tensor (local name) to the original tensor whose shard and
    dtype it takes; ``removed`` lists the original tensors that are dropped.
    """

    group: AttentionGroup
    mode: str
    zero_attn: bool
    action: str
    refusal: str | None = None
    removed: frozenset[str] = frozenset()
    placed: dict[str, str] = field(default_factory=dict)
    fold_value: bool = False

    @property
    def changes(self) -> bool:
        return bool(self.removed or self.placed)


def plan_module(group: AttentionGroup, mode: str, *, zero_attn: bool, fold_value_bias: bool = False) -> ModulePlan:
    """Decide, from the layout alone, what ``mode`` does to ``group``.

    ``strip`` writes the key-bias-free layout (``q_proj_bias``, ``v_proj_bias``); ``fold`` writes
    stock's layout with the key slot of ``in_proj_bias`` zeroed, which stock and slim both load;
    ``to-stock`` turns the key-bias-free layout back into stock's. A plan with a ``refusal`` says why
    ``mode`` cannot convert this module exactly.

    Raises:
        ValueError: the checkpoint contradicts the ``add_zero_attn`` mark.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    zero_attn = zero_attn or "k_proj_bias" in group
    if zero_attn and group.is_slim and "k_proj_bias" not in group:
        raise ValueError(
            f"{group.where('q_proj_bias')}: '{shown(group.name)}' is marked add_zero_attn but has no k_proj_bias; "
            "a slim add_zero_attn module keeps its key bias, so this checkpoint lost it when it was "
            f"converted without the mark: convert the original stock checkpoint again with {option('zero_attn')}"
        )
    if mode == "to-stock":
        return _plan_to_stock(group, zero_attn)
    if mode == "fold" and group.is_slim:  # the key-bias-free layout: stock's, with the key slot zero
        plan = _plan_to_stock(group, zero_attn)
        if plan.refusal:
            return replace(plan, mode=mode)
        return _with_value_fold(group, mode, zero_attn, fold_value_bias, [plan.action], set(plan.removed), plan.placed)
    if mode == "fold":
        return _plan_fold(group, zero_attn, fold_value_bias)
    return _plan_strip(group, zero_attn, fold_value_bias)


def _plan_strip(group: AttentionGroup, zero_attn: bool, fold_value: bool) -> ModulePlan:
    removed: set[str] = set()
    placed: dict[str, str] = {}
    if "in_proj_bias" in group:
        if group.has_bias_kv:
            return ModulePlan(
                group,
                "strip",
                zero_attn,
                "refuses: bias_k is present (use fold)",
                refusal=f"bias_k is present ({group.where('bias_k')}), so dropping the key bias is not "
                "exact; use fold, which folds it into bias_k",
            )
        if zero_attn:
            return ModulePlan(
                group,
                "strip",
                zero_attn,
                "refuses: add_zero_attn (use fold)",
                refusal="it is marked add_zero_attn, and the zero key makes the key bias matter; use fold, "
                "which keeps stock's layout for it",
            )
        removed.add("in_proj_bias")
        placed.update(q_proj_bias="in_proj_bias", v_proj_bias="in_proj_bias")
        actions = ["drop the key slice of in_proj_bias"]
    else:
        actions = ["nothing to do (already slim)" if group.is_slim else "nothing to do (no input bias)"]
    return _with_value_fold(group, "strip", zero_attn, fold_value, actions, removed, placed)


def _plan_fold(group: AttentionGroup, zero_attn: bool, fold_value: bool) -> ModulePlan:
    if "in_proj_bias" not in group:
        return ModulePlan(group, "fold", zero_attn, "nothing to do (no input bias)")
    if keeps_key_bias(add_zero_attn=zero_attn):
        action = "nothing to fold (add_zero_attn: the zero key makes the key bias matter; stock's layout kept)"
        if fold_value:
            return _with_value_fold(group, "fold", zero_attn, fold_value, [action], set(), {})
        return ModulePlan(group, "fold", zero_attn, action)
    placed = {"in_proj_bias": "in_proj_bias"}
    if group.has_bias_kv:
        placed["bias_k"] = "bias_k"
        actions = ["zero the key slot of in_proj_bias, fold it into bias_k"]
    else:
        actions = ["zero the key slot of in_proj_bias"]
    return _with_value_fold(group, "fold", zero_attn, fold_value, actions, set(), placed)


def keep_module(plan: ModulePlan, why: str) -> ModulePlan:
    """``plan``'s module left as it is: no tensor changed, and the report says why."""
    return ModulePlan(plan.group, plan.mode, plan.zero_attn, f"kept as it is ({why})")


def already_folded(plan: ModulePlan, read: Callable[[str], Tensor]) -> ModulePlan:
    """``fold``'s plan for a module whose key slot is already zero: nothing to do, as ``strip`` and
    ``to-stock`` say for a module already in their layout (the data decides, so it is read here)."""
    group = plan.group
    if (
        plan.mode != "fold"
        or plan.fold_value
        or plan.removed
        or not plan.placed
        or set(plan.placed) - {"in_proj_bias", "bias_k"}
        or "in_proj_bias" not in group
    ):
        return plan
    key_slot = read("in_proj_bias")[group.embed_dim : 2 * group.embed_dim]
    if bool(key_slot.any()):
        return plan
    return replace(plan, action="nothing to do (the key slot is already zero)", placed={})


def _with_value_fold(
    group: AttentionGroup,
    mode: str,
    zero_attn: bool,
    fold_value: bool,
    actions: list[str],
    removed: set[str],
    placed: dict[str, str],
) -> ModulePlan:
    """The plan, with ``b_v`` folded into ``out_proj.bias`` too when asked (refused with add_zero_attn)."""
    value_bias_present = "in_proj_bias" in group or "v_proj_bias" in group
    if fold_value and value_bias_present:
        if zero_attn:
            return ModulePlan(
                group,
                mode,
                zero_attn,
                "refuses: --fold-value-bias with add_zero_attn",
                refusal="it is marked add_zero_attn, and the zero value token cannot absorb -b_v, so "
                "--fold-value-bias would change its output; drop --fold-value-bias",
            )
        fold_text = "fold the value bias into out_proj.bias (exact in eval only)"
        actions = actions + [fold_text] if placed else [fold_text]
        placed = dict(placed)
        placed.pop("v_proj_bias", None)
        if "v_proj_bias" in group:
            removed = removed | {"v_proj_bias"}
        if mode == "fold" and "in_proj_bias" in group:
            placed["in_proj_bias"] = "in_proj_bias"  # its value slot is zeroed
        placed["out_proj.bias"] = "out_proj.bias"
        if group.has_bias_kv:
            placed["bias_v"] = "bias_v"
    return ModulePlan(
        group,
        mode,
        zero_attn,
        "; ".join(actions),
        removed=frozenset(removed),
        placed=placed,
        fold_value=fold_value and value_bias_present,
    )


def _plan_to_stock(group: AttentionGroup, zero_attn: bool) -> ModulePlan:
    if not group.is_slim:
        action = "nothing to do (already stock)" if group.has_bias else "nothing to do (no input bias)"
        return ModulePlan(group, "to-stock", zero_attn, action)
    present = [name for name in BIAS_NAMES if name in group]
    dtypes = {group.records[name].dtype for name in present}
    if len(dtypes) > 1:
        return ModulePlan(
            group,
            "to-stock",
            zero_attn,
            "refuses: input biases of different dtypes",
            refusal=f"its input biases have dtypes {', '.join(sorted(dtypes))}, which cannot be packed into "
            "one in_proj_bias; cast them to one dtype",
        )
    key_slice = "the kept k_proj_bias" if "k_proj_bias" in group else "a zero key slice"
    action = f"pack the input biases into in_proj_bias with {key_slice}"
    if "v_proj_bias" not in group:
        action += " and a zero value slice (the value bias was folded into out_proj.bias)"
    return ModulePlan(
        group, "to-stock", zero_attn, action, removed=frozenset(present), placed={"in_proj_bias": "q_proj_bias"}
    )


def migrated_tensors(plan: ModulePlan, read: Callable[[str], Tensor]) -> dict[str, Tensor]:
    """The module's new and rewritten tensors (``plan.placed``), each in its target dtype.

    ``read(local)`` returns an original tensor of the module by its local name.
    """
    group = plan.group
    embed_dim = group.embed_dim

    def wide(local: str) -> Tensor | None:
        return read(local).to(_WIDE) if local in group else None

    current: dict[str, Tensor | None] = {}
    if plan.mode == "strip" and "in_proj_bias" in plan.removed:
        current.update(fold_key_bias(wide("in_proj_bias"), add_zero_attn=plan.zero_attn)._asdict())
    elif "in_proj_bias" in group and "in_proj_bias" in plan.placed:  # fold: stock's layout, key slot zeroed
        current["in_proj_bias"], current["bias_k"] = zero_key_bias(
            wide("in_proj_bias"), wide("bias_k"), add_zero_attn=plan.zero_attn
        )
    elif group.is_slim and "in_proj_bias" in plan.placed:  # to-stock, or fold of the key-bias-free layout
        # bias_k comes back as stored (see unfold_key_bias), so it is neither read nor rewritten.
        biases = SlimBiases(
            q_proj_bias=wide("q_proj_bias"),
            k_proj_bias=wide("k_proj_bias"),
            v_proj_bias=wide("v_proj_bias"),
            bias_k=None,
        )
        current["in_proj_bias"], _ = unfold_key_bias(biases, embed_dim=embed_dim)
    if plan.fold_value:
        packed = current.get("in_proj_bias") if "in_proj_bias" in current else wide("in_proj_bias")
        value_bias = current.get("v_proj_bias")
        if value_bias is None:
            value_bias = packed[2 * embed_dim :] if packed is not None else wide("v_proj_bias")
        if value_bias is None:  # planned only for a module with a value bias
            raise ValueError(f"'{shown(group.name)}' has no value bias to fold")
        weight = read("out_proj.weight")
        # fold_value_bias_into_output multiplies in the weight's dtype (at least fp32): widen it to the bias's too.
        work = torch.promote_types(weight.dtype, FLOAT_DTYPES[group.records["out_proj.bias"].dtype])
        current["out_proj.bias"], current["bias_v"] = fold_value_bias_into_output(
            value_bias, weight.to(work), wide("out_proj.bias"), wide("bias_v"), add_zero_attn=plan.zero_attn
        )
        if "in_proj_bias" in plan.placed and packed is not None:  # the value slot folded: zeros in the file
            current["in_proj_bias"] = torch.cat([packed[: 2 * embed_dim], packed.new_zeros(embed_dim)])
    result = {}
    for local, source in plan.placed.items():
        tensor = current.get(local)
        if tensor is None:  # every placed tensor is computed above
            raise ValueError(f"'{shown(group.name)}': {local} was planned but not computed")
        result[local] = tensor.to(FLOAT_DTYPES[group.records[source].dtype]).contiguous()
    return result
