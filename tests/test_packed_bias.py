"""The packed bias's owner and its three operations, on their own.

``resync`` re-points only parameter objects aliased before, ``take_new_parameters`` also objects
registered since whose memory is their own, ``reown`` objects the module itself registered, whatever
their memory. The idioms that rely on them are compared with stock in tests/test_in_the_wild.py and
tests/test_stock_contract.py.
"""

from __future__ import annotations

import torch
from torch import nn

from slim_mha import SlimMultiheadAttention
from slim_mha import _packed_tensor as packed_tensor
from slim_mha._packed_bias import PackedBiasOwner
from slim_mha.bias import BIAS_NAMES

E = 8


def is_aliased(module) -> bool:
    packed = module.__dict__[packed_tensor.STATE_KEY].packed
    return module.q_proj_bias.data_ptr() == packed.data_ptr() and (
        module.v_proj_bias.data_ptr() == packed.data_ptr() + 2 * E * packed.element_size()
    )


def test_attention_defines_no_hook_of_its_own_beyond_forward_and_scripting():
    """Every hook that must keep the two names one state lives in the owner."""
    module_attributes = set(vars(nn.Module)) | set(vars(nn.MultiheadAttention))
    overridden = module_attributes & set(vars(SlimMultiheadAttention))
    assert overridden <= {"__init__", "__prepare_scriptable__", "_reset_parameters", "extra_repr", "forward", "__doc__",
                          "__module__", "__annotations__", "_version", "__qualname__"}, overridden
    owner_hooks = {"_load_from_state_dict", "_save_to_state_dict", "_apply", "train", "__getstate__",
                   "__setstate__", "__setattr__", "register_parameter", "in_proj_bias"}
    assert owner_hooks <= set(vars(PackedBiasOwner))


def test_resync_leaves_a_new_parameter_object_alone_and_take_new_parameters_takes_it():
    module = SlimMultiheadAttention(E, 2)
    module.q_proj_bias = nn.Parameter(torch.randn(E))  # a loader's setattr: memory of its own
    assert packed_tensor.resync(module) is None and not is_aliased(module)
    packed = packed_tensor.take_new_parameters(module)
    assert packed is module.in_proj_bias and is_aliased(module)
    assert torch.equal(packed[:E], module.q_proj_bias.detach())


def test_only_reown_takes_parameters_viewing_someone_else_s_buffer():
    module = SlimMultiheadAttention(E, 2)
    buffer = torch.randn(4 * E)  # an all-gather buffer, say
    for index, name in enumerate(("q_proj_bias", "v_proj_bias")):
        setattr(module, name, nn.Parameter(buffer[index * E : (index + 1) * E]))
    assert packed_tensor.take_new_parameters(module) is None and not is_aliased(module)
    assert packed_tensor.reown(module) is not None and is_aliased(module)


def test_resync_takes_in_data_given_to_in_proj_bias():
    module = SlimMultiheadAttention(E, 2)
    new = torch.randn(3 * E)
    module.in_proj_bias.data = new.clone()
    assert is_aliased(module)  # taken in at once, by the owner
    assert torch.equal(module.q_proj_bias.detach(), new[:E]) and torch.equal(module.v_proj_bias.detach(), new[2 * E :])
    assert packed_tensor.resync(module) is module.in_proj_bias


def test_the_bias_names_are_the_registered_parameters_in_packed_order():
    module = SlimMultiheadAttention(E, 2, add_zero_attn=True)
    names = [name for name, _ in module.named_parameters() if name.endswith("_proj_bias")]
    assert tuple(sorted(names, key=BIAS_NAMES.index)) == BIAS_NAMES
