"""The stock ``in_proj_bias`` of a slim module: one tensor that the bias parameters are views of.

Code written for stock reads *and writes* ``in_proj_bias``: ``nn.init.zeros_(m.in_proj_bias)``,
``m.in_proj_bias.data.copy_(t)``, open_clip's ``t.data = t.data.to(torch.bfloat16)``. Slim's
parameters are ``q_proj_bias`` and ``v_proj_bias`` (and ``k_proj_bias`` where the key bias is kept).
So that both names are one state, each module keeps one contiguous ``(3E,)`` tensor,
``packed = [b_q | middle | b_v]``, in its ``__dict__`` (not a parameter, not in the state dict), and
its bias parameters are views of its slices. A write through either name is a write to the same
memory; ``in_proj_bias`` returns that same object every time; and the fused projection uses it as
its bias with no per-call work. Nothing is cached: there is one copy of the numbers.

``middle`` is ``k_proj_bias`` when the key bias is kept. Otherwise it is a slot that is zero
unless code writes stock's key bias into it; the forward then adds it to the keys exactly as stock
would (with ``add_bias_kv`` it changes the function relative to ``bias_k``, as in stock), and
``state_dict`` folds it into ``bias_k`` (see :mod:`slim_mha.bias`).

Aliasing can break: ``p.data = new`` on a parameter, casts and moves (``_apply``),
``functional_call`` and ``vmap`` passing other tensors, FSDP re-pointing parameters, or
``in_proj_bias.data = new`` (which the parameters take in at once, see :class:`PackedParameter`).
So every use *verifies* it (the registered objects, views of the packed
memory at the right offsets, one dtype) and otherwise builds the bias from the parameters as they
are at that moment. Aliasing is re-made only where the module owns its parameters (construction,
``_apply``, loading, assignment, reading ``in_proj_bias``), never while a trace, ``torch.compile``
or a functorch transform runs, and never with tensors that are not the module's own registered
plain ``Parameter`` objects. A ``torch.compile`` trace reads the packed memory (the middle slot)
through a plain tensor aliasing it, made at each verification: Dynamo on torch 2.4 cannot look
into the packed Parameter subclass.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.nn.parameter import Parameter
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["STATE_KEY", "assign", "create", "fused_bias", "is_transforming", "set_middle", "stock_view", "sync"]

STATE_KEY = _STATE = "_packed_bias_state"
_PARTS = ("q_proj_bias", "k_proj_bias", "v_proj_bias")  # the order of the packed slices
# Flags that loaders put on tensors they filled (Hugging Face's init guard skips tensors carrying
# ``_is_hf_initialized``): the packed view carries one when every part of it does, so that an
# ``nn.init.zeros_(m.in_proj_bias)`` after loading is skipped exactly when stock's would be.
_LOADED_FLAGS = ("_is_hf_initialized",)


_set_data = torch._C.TensorBase.data.__set__  # re-point a tensor without our notification
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # packed tensor -> weakref to its module


class PackedParameter(Parameter):
    """The ``in_proj_bias`` object: ``.data = new`` on it is taken in by the bias parameters at once.

    open_clip's ``t.data = t.data.to(torch.bfloat16)`` re-points the object it read; the module
    is told right away (outside traces and transforms), so no forward, compiled or not, ever sees
    the parameters and the packed view disagree. The forward still verifies, as for every change.
    """

    @property
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        _set_data(self, value)
        owner = _OWNERS.get(self)
        module = owner() if owner is not None else None
        if module is not None and not is_transforming():
            sync(module)


class PackedBias:
    """The packed tensor and what it was last verified against.

    A plain class (no ``__slots__``): Dynamo on torch 2.4 cannot read slot attributes.
    """

    def __init__(self, module, packed: Tensor, parts: tuple) -> None:
        self.packed = packed
        self.hooked = False
        # A PackedParameter takes in ``.data = new`` at once (outside transforms); an assigned plain
        # Parameter is only checked at the next eager use.
        self.notifies = isinstance(packed, PackedParameter)
        self.record(parts)
        if self.notifies:
            _OWNERS[packed] = weakref.ref(module)

    def record(self, parts: tuple) -> None:
        self.parts = parts
        # A plain tensor on the packed memory, for traces: Dynamo on torch 2.4 cannot look into a
        # Parameter subclass at all, so a compiled forward reads the middle slot through this.
        self.memory = self.packed.detach()
        self.address = self.packed.data_ptr()
        self.itemsize = self.packed.element_size()
        self.dtype = self.packed.dtype
        self.requires_grad = self.packed.requires_grad


def is_transforming() -> bool:
    """Whether a graph is being captured or a functorch transform runs: no state may change then."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
    )


def create(module, *, bias: bool, keep_key: bool, factory: dict) -> None:
    """Register ``q_proj_bias``/``k_proj_bias``/``v_proj_bias`` as views of one new packed tensor."""
    if not bias:
        for name in _PARTS:
            module.register_parameter(name, None)
        return
    # A Parameter (unregistered), as stock's in_proj_bias is one: isinstance checks keep passing.
    _register_views(module, PackedParameter(torch.zeros(3 * module.embed_dim, **factory)), keep_key, True)


def assign(module, value: Tensor, *, keep_key: bool) -> None:
    """``module.in_proj_bias = value`` (a ``(3E,)`` Parameter): it becomes the packed tensor, as stock
    registers the object; new bias parameters (with its ``requires_grad``) are views of it.
    ``None`` removes the input biases, as ``bias=False``."""
    if value is None:
        for name in _PARTS:
            module.register_parameter(name, None)
        module.__dict__.pop(_STATE, None)
        return
    if not value.is_contiguous():
        value = Parameter(value.detach().contiguous(), requires_grad=value.requires_grad)
    _register_views(module, value, keep_key, value.requires_grad)


def _register_views(module, packed: Tensor, keep_key: bool, requires_grad: bool) -> None:
    E = module.embed_dim
    data = packed.detach()
    present = (True, keep_key, True)
    for index, name in enumerate(_PARTS):
        view = data[index * E : (index + 1) * E]
        module.register_parameter(name, Parameter(view, requires_grad=requires_grad) if present[index] else None)
    module.__dict__[_STATE] = PackedBias(module, packed, _current_parts(module))


def fused_bias(module) -> Tensor | None:
    """``[b_q; middle; b_v]`` for the fused input projection, from the parameters as they are now.

    Without a graph to record and with the parameters still views of the packed tensor, that tensor
    is the answer and costs nothing. Otherwise one ``cat`` of the parameters (gradients flow to
    them only; the middle slot is detached).
    """
    parts = _current_parts(module)
    if _absent(parts):
        return None
    state = module.__dict__.get(_STATE)
    if state is not None and not is_transforming():
        if _packed_was_repointed(state, parts):
            _adopt_packed(module, state, parts)  # in_proj_bias.data = ...: the parameters follow
        if state.packed.requires_grad != state.requires_grad:  # in_proj_bias.requires_grad_(...)
            _sync_flags(module, state, parts)
        records_graph = torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in parts)
        if not records_graph and _is_aliased(state, parts, module.embed_dim):
            return state.packed
    elif state is not None and _same_objects(parts, state.parts) and _has_unfolded_dtype_or_device(state, parts):
        raise RuntimeError(
            "in_proj_bias was given data of another dtype or device than q_proj_bias/v_proj_bias and "
            "has not been folded into them yet: run one eager forward (or read module.in_proj_bias) "
            "before tracing, compiling or transforming the module"
        )
    return _concatenate(module, state, parts)


def stock_view(module) -> Tensor | None:
    """What ``in_proj_bias`` returns: the packed tensor itself wherever aliasing holds or can be made.

    Under a trace or a transform, or when the parameters cannot be aliased (not plain registered
    ``Parameter`` objects of one dtype and device, e.g. FSDP's DTensors), a computed tensor is
    returned: reading it is exact, writing to it reaches nothing.
    """
    packed = sync(module)
    if packed is not None:
        return packed
    parts = _current_parts(module)
    if _absent(parts):
        return None
    return _concatenate(module, module.__dict__.get(_STATE), parts)


def sync(module, *, take_new_parameters: bool = False, owned: bool = False) -> Tensor | None:
    """Make the parameters views of the packed tensor again, if needed and allowed; return it or None.

    Only the parameter objects aliased before are re-pointed, unless ``take_new_parameters``; and
    only parameters whose memory is their own, unless ``owned`` (places that own what they
    register: ``_apply``, loading, unpickling). Parameter objects
    registered by others may have memory someone else manages: FSDP2 registers its unsharded
    parameters with ``setattr`` and later refills their memory, so re-pointing them would freeze
    them at stale values. Such parameters stay where they are; the forward builds the bias from them.

    Resolves who changed since the last check: if only ``in_proj_bias`` got new data, the parameters
    take it; if only parameters did, the packed tensor is rebuilt from them (same object, new
    data, so tensors handed out earlier stay the stock view); if both did, that is an error.
    """
    parts = _current_parts(module)
    if _absent(parts) or is_transforming():  # no data pointers (nor changes) inside a trace
        return None
    state = module.__dict__.get(_STATE)
    E = module.embed_dim
    if state is None or not _is_aliased(state, parts, E):
        if state is not None and _packed_was_repointed(state, parts):
            _adopt_packed(module, state, parts)
        elif state is not None and state.packed.data_ptr() != state.address and _same_objects(parts, state.parts):
            raise RuntimeError(
                "in_proj_bias and q_proj_bias/v_proj_bias were all given new data since they were "
                "last in sync, so neither can be taken as the truth: assign the new values through one "
                "of them only (e.g. module.q_proj_bias.data = ...)"
            )
        elif (take_new_parameters or (state is not None and _same_objects(parts, state.parts))) and _can_alias(
            module, parts, owned
        ):
            _realias(module, state, parts)
        else:
            return None
        state = module.__dict__[_STATE]
    _sync_flags(module, state, parts)
    return state.packed


def stock_middle(module) -> Tensor | None:
    """The middle slot as it reads in ``in_proj_bias`` when it is not ``k_proj_bias``, else None."""
    state = module.__dict__.get(_STATE)
    if state is None or module.k_proj_bias is not None or state.packed.is_meta:
        return None
    E = module.embed_dim
    return state.packed.detach()[E : 2 * E]


def set_middle(module, value: Tensor | None) -> None:
    """Write the middle slot (not a parameter; ``None`` zeroes it), when it is not ``k_proj_bias``."""
    middle = stock_middle(module)
    if middle is not None:
        with torch.no_grad():
            middle.zero_() if value is None else middle.copy_(value)


# ----------------------------------------------------------------------------------- internals


def _current_parts(module) -> tuple:
    # Straight from the registry (functional_call swaps tensors there too); a parametrized module
    # has moved them out, so fall back to attribute access, which computes them.
    parameters = module._parameters
    try:
        return parameters["q_proj_bias"], parameters["k_proj_bias"], parameters["v_proj_bias"]
    except KeyError:
        return module.q_proj_bias, module.k_proj_bias, module.v_proj_bias


def _absent(parts: tuple) -> bool:
    return parts[0] is None and parts[1] is None and parts[2] is None


def _same_objects(parts: tuple, recorded: tuple) -> bool:
    return parts[0] is recorded[0] and parts[1] is recorded[1] and parts[2] is recorded[2]


def _first_present(parts: tuple) -> Tensor:
    # A loop, not next() over a generator: Dynamo on older torch cannot trace the latter.
    for part in parts:
        if part is not None:
            return part
    raise AssertionError("no bias parameter present")


def _views_at(parts: tuple, address: int, itemsize: int, dtype: torch.dtype, E: int) -> bool:
    for index, part in enumerate(parts):
        if part is not None and (part.dtype != dtype or part.data_ptr() != address + index * E * itemsize):
            return False
    return True


def _is_aliased(state: PackedBias, parts: tuple, E: int) -> bool:
    if not _same_objects(parts, state.parts):
        return False
    packed = state.packed
    return _views_at(parts, packed.data_ptr(), packed.element_size(), packed.dtype, E)


def _packed_was_repointed(state: PackedBias, parts: tuple) -> bool:
    """``in_proj_bias.data = new``: the packed tensor moved while the parameters stayed where they were."""
    packed = state.packed
    if packed.data_ptr() == state.address and packed.dtype == state.dtype:
        return False
    if not _same_objects(parts, state.parts):
        return False
    E = packed.shape[0] // 3 if packed.dim() == 1 else -1
    return E > 0 and _views_at(parts, state.address, state.itemsize, state.dtype, E)


def _has_unfolded_dtype_or_device(state: PackedBias, parts: tuple) -> bool:
    """``in_proj_bias.data = new`` of another dtype or device, not yet taken in by the parameters
    (an assigned plain ``Parameter`` is told nothing; nor is a PackedParameter inside a transform)."""
    packed = _traceable_packed(state)
    reference = _first_present(parts)
    return packed.dtype != reference.dtype or packed.device != reference.device


def _traceable_packed(state: PackedBias) -> Tensor:
    """The packed tensor, or its plain alias under ``torch.compile`` where it is a PackedParameter.

    Dynamo on torch 2.4 cannot look into a Parameter subclass. The alias is current there: a
    PackedParameter takes in new data when it is given it, and ``record`` makes a new alias.
    """
    if state.notifies and torch.compiler.is_compiling():
        return state.memory
    return state.packed


def _can_alias(module, parts: tuple, owned: bool = False) -> bool:
    E = module.embed_dim
    reference = _first_present(parts)
    for name, part in zip(_PARTS, parts):
        if part is None:
            continue
        if type(part) is not Parameter or module._parameters.get(name) is not part:
            return False
        if tuple(part.shape) != (E,) or part.layout != torch.strided:
            return False
        if part.dtype != reference.dtype or part.device != reference.device:
            return False
        if not owned and not _owns_its_memory(part, module.__dict__.get(_STATE)):
            return False
    return True


def _owns_its_memory(part: Tensor, state: PackedBias | None) -> bool:
    """Whether re-pointing ``part.data`` can hurt nobody: its memory is its own, or already ours.

    A parameter that views a larger buffer belongs to whoever manages that buffer: FSDP's
    all-gather output (it refills the buffer and expects the parameter to show it), a flat
    parameter, ``vector_to_parameters``' vector. Those are left where they are; the forward then
    builds the bias from them on every call.
    """
    storage = part.untyped_storage()
    if state is not None and storage.data_ptr() == state.packed.untyped_storage().data_ptr():
        return True
    return part.storage_offset() == 0 and storage.nbytes() == part.numel() * part.element_size()


def _realias(module, state: PackedBias | None, parts: tuple) -> None:
    """Rebuild the packed tensor from the parameters and make them views of it."""
    E = module.embed_dim
    reference = _first_present(parts)
    zeros = torch.zeros(E, dtype=reference.dtype, device=reference.device)
    middle = zeros
    if parts[1] is not None:
        middle = parts[1].detach()
    elif state is not None and not state.packed.is_meta and tuple(state.packed.shape) == (3 * E,):
        middle = state.packed.detach()[E : 2 * E].to(dtype=reference.dtype, device=reference.device)
    pieces = [parts[0], middle, parts[2]]
    with torch.no_grad():
        data = torch.cat([zeros if p is None else p.detach() for p in pieces])
    try:
        if state is None:
            raise RuntimeError("no packed tensor yet")
        _set_data(state.packed, data)  # the same object: in_proj_bias handed out earlier stays the view
    except RuntimeError:  # none yet, or one that cannot take this data (meta to real memory)
        requires_grad = any(p is not None and p.requires_grad for p in parts)
        packed = PackedParameter(data, requires_grad=requires_grad)
        state = module.__dict__[_STATE] = PackedBias(module, packed, parts)
    for index, part in enumerate(parts):
        if part is not None:
            part.data = data[index * E : (index + 1) * E]
    state.record(parts)


def _adopt_packed(module, state: PackedBias, parts: tuple) -> None:
    """``in_proj_bias.data = new``: make the parameters views of the new data (its dtype and device too)."""
    E = module.embed_dim
    packed = state.packed
    if tuple(packed.shape) != (3 * E,):
        raise RuntimeError(
            f"in_proj_bias was given data of shape {tuple(packed.shape)}; it must keep shape ({3 * E},) "
            "= 3*embed_dim"
        )
    if not packed.is_contiguous():
        _set_data(packed, packed.detach().contiguous())
    data = packed.detach()
    for index, part in enumerate(parts):
        if part is not None:
            part.data = data[index * E : (index + 1) * E]
    state.record(parts)


def _concatenate(module, state: PackedBias | None, parts: tuple) -> Tensor:
    """``cat([b_q, middle, b_v])`` from the parameters, differentiable in them."""
    E = module.embed_dim
    reference = _first_present(parts)
    zeros = None

    def zero() -> Tensor:
        nonlocal zeros
        if zeros is None:
            zeros = reference.new_zeros(E)
        return zeros

    middle = parts[1]
    if middle is None:
        # The slot changes the function only relative to appended tokens (add_bias_kv).
        packed = _traceable_packed(state) if module.bias_k is not None and state is not None else None
        if packed is not None and not packed.is_meta:
            middle = packed.detach()[E : 2 * E].to(dtype=reference.dtype, device=reference.device)
        else:
            middle = zero()
    return torch.cat([zero() if parts[0] is None else parts[0], middle, zero() if parts[2] is None else parts[2]])


def _sync_flags(module, state: PackedBias, parts: tuple) -> None:
    """``requires_grad`` and loaders' flags: the packed tensor and its parts agree, whoever changed."""
    packed = state.packed
    present = [p for p in parts if p is not None]
    if packed.requires_grad != state.requires_grad:  # requires_grad_ on in_proj_bias: parts follow
        for part in present:
            part.requires_grad_(packed.requires_grad)
    else:
        wanted = any(p.requires_grad for p in present)
        if packed.requires_grad != wanted:
            try:
                packed.requires_grad_(wanted)
            except RuntimeError:  # an inference tensor outside inference mode keeps its flag
                pass
    state.requires_grad = packed.requires_grad
    if packed.requires_grad and not state.hooked:
        packed.register_post_accumulate_grad_hook(_GradientRouter(module))
        state.hooked = True
    for flag in _LOADED_FLAGS:
        if all(getattr(p, flag, False) for p in present):
            setattr(packed, flag, True)
        elif flag in packed.__dict__:
            delattr(packed, flag)


class _GradientRouter:
    """Gradients that code computing with ``in_proj_bias`` itself accumulates land in the parameters.

    Stock's ``in_proj_bias`` is a ``Parameter``, so ``loss(m.in_proj_bias).backward()`` fills its
    ``.grad``. Here the slices go to ``q_proj_bias``/``v_proj_bias`` (and a kept ``k_proj_bias``)
    instead, where optimizers see them; a dropped key bias has no parameter and gets none.
    """

    def __init__(self, module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, packed: Tensor) -> None:
        grad, packed.grad = packed.grad, None
        module = self.module()
        if module is None or grad is None:
            return
        E = module.embed_dim
        with torch.no_grad():
            for index, part in enumerate(_current_parts(module)):
                if part is None or not part.requires_grad:
                    continue
                piece = grad[index * E : (index + 1) * E].to(part.dtype)
                if part.grad is None:
                    part.grad = piece.clone()
                else:
                    part.grad.add_(piece)
