"""The packed tensor behind ``in_proj_bias``: one ``(3E,)`` tensor the bias parameters are views of.

Each module keeps ``packed = [b_q | middle | b_v]`` in its ``__dict__`` (not a parameter, not in the
state dict), and its bias parameters are views of its slices: a write through either name is a write
to the same memory, ``in_proj_bias`` is that same object every time, and the fused projection uses
it as its bias with no per-call work. Nothing is cached: there is one copy of the numbers.
``middle`` is ``k_proj_bias`` when the key bias is kept; otherwise a slot that is zero unless code
writes stock's key bias into it, which the forward then adds to the keys exactly as stock would.

Aliasing can break (``p.data = new``, casts, ``functional_call`` and ``vmap``, FSDP, or
``in_proj_bias.data = new``), so every use verifies it (the registered objects, views of the packed
memory at the right offsets, one dtype) and otherwise builds the bias from the parameters as they
are. It is re-made only where :mod:`slim_mha._packed_bias` says, never while a graph is captured or
a functorch transform runs. Under ``torch.compile`` the middle slot is read through a plain tensor
aliasing the packed memory: Dynamo on torch 2.4 cannot look into the Parameter subclass.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.nn.parameter import Parameter
from torch.utils.weak import WeakIdKeyDictionary

from ._bias_views import ComputedStockBias, copy_loaded_flags, unaliased_message
from ._torch_compat import is_capturing_graph
from ._torch_compat import is_capturing_or_transforming as is_transforming
from .bias import BIAS_NAMES

__all__ = ["STATE_KEY", "assign", "create", "fused_bias", "is_packed", "reown", "resync", "stock_view", "take_new_parameters"]

STATE_KEY = _STATE = "_packed_bias_state"
_STAND_IN = "_in_proj_bias_stand_in"  # a plain tensor assigned to in_proj_bias (see assign)


# The tensor attributes themselves, bypassing PackedParameter's overrides.
_set_data = torch._C.TensorBase.data.__set__
_get_grad = torch._C.TensorBase.grad.__get__
_set_grad = torch._C.TensorBase.grad.__set__
_get_requires_grad = torch._C.TensorBase.requires_grad.__get__
_set_requires_grad = torch._C.TensorBase.requires_grad.__set__
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # packed tensor -> weakref to its module


class PackedParameter(Parameter):
    """The ``in_proj_bias`` object: stock's idioms on it reach the bias parameters at once.

    * ``.data = new`` (open_clip's ``t.data = t.data.to(torch.bfloat16)``) is taken in by the
      parameters right away (outside traces and transforms), so no forward, compiled or not, ever
      sees the parameters and the packed view disagree. The forward still verifies, as for every change.
    * ``.requires_grad_(flag)`` and ``.requires_grad = flag`` reach the parameters at once, so a
      wrapper built next (DDP) sees the frozen bias as frozen.
    * ``.grad`` is the parameters' gradients packed as stock's ``[g_q; g_k; g_v]``, which their
      ``.grad`` are views of: an optimizer or ``clip_grad_norm_`` handed ``in_proj_bias`` reads and
      scales what autograd gave the parameters and updates their memory. A dropped key bias reads 0.
    """

    @property
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        _set_data(self, value)
        module = _owner(self)
        if module is not None and not is_transforming():
            resync(module)

    @property
    def grad(self) -> Tensor | None:
        module = _owner(self)
        if module is None or is_transforming():
            return _get_grad(self)
        return _gather_gradient(module, self)

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        module = _owner(self)
        if module is None or is_transforming():
            _set_grad(self, value)
        else:
            _scatter_gradient(module, self, value)

    @property
    def requires_grad(self) -> bool:
        return _get_requires_grad(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _set_requires_grad(self, value)
        _parts_follow_flag(self)

    def requires_grad_(self, requires_grad: bool = True) -> "PackedParameter":
        torch._C.TensorBase.requires_grad_(self, requires_grad)
        _parts_follow_flag(self)
        return self


class PackedBias:
    """The packed tensor and what it was last verified against.

    A plain class (no ``__slots__``): Dynamo on torch 2.4 cannot read slot attributes.
    """

    def __init__(self, module, packed: Tensor, parts: tuple) -> None:
        self.packed = packed
        self.hooked = False
        # in_proj_bias.grad: the (3E,) tensor the parameters' .grad were last made views of, and those views.
        self.gradient = None
        self.gradient_views = (None, None, None)
        self.earlier = None  # the state an assigned in_proj_bias replaced (see assign)
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


def create(module, *, bias: bool, keep_key: bool, factory: dict) -> None:
    """Register ``q_proj_bias``/``k_proj_bias``/``v_proj_bias`` as views of one new packed tensor."""
    if not bias:
        for name in BIAS_NAMES:
            module.register_parameter(name, None)
        return
    # A Parameter (unregistered), as stock's in_proj_bias is one: isinstance checks keep passing.
    _register_views(module, PackedParameter(torch.zeros(3 * module.embed_dim, **factory)), keep_key, True)


def assign(module, value: Tensor | None, *, keep_key: bool) -> None:
    """``module.in_proj_bias = value``, as stock takes each kind of value.

    * A ``(3E,)`` ``Parameter`` becomes the packed tensor, as stock registers the object: new bias
      parameters (with its ``requires_grad``) are views of it. Assigning back a packed tensor that
      this module had before restores the parameter objects of that time, so a swap and its undo
      (``torch.func.functional_call``) leave the module with the very objects optimizers hold.
    * A plain tensor is a stand-in: the forward uses it as stock's ``in_proj_bias`` (its key slot
      too) until the packed tensor is assigned back. This is how ``functional_call`` with stock's
      parameter names swaps it in (stock writes its registry directly; it is not registered here).
    * ``None`` removes the input biases, as ``bias=False``.
    """
    module.__dict__.pop(_STAND_IN, None)
    state = module.__dict__.get(_STATE)
    if value is not None and not isinstance(value, Parameter):
        module.__dict__[_STAND_IN] = value
        return
    if state is not None and value is state.packed:
        return
    earlier = state.earlier if state is not None else None
    while earlier is not None and earlier.packed is not value:
        earlier = earlier.earlier
    if earlier is not None:
        for name, part in zip(BIAS_NAMES, earlier.parts):
            module.register_parameter(name, part)
        module.__dict__[_STATE] = earlier
        resync(module)
        return
    if value is None:
        for name in BIAS_NAMES:
            module.register_parameter(name, None)
        module.__dict__.pop(_STATE, None)
        return
    if not value.is_contiguous():
        value = Parameter(value.detach().contiguous(), requires_grad=value.requires_grad)
    _register_views(module, value, keep_key, value.requires_grad)
    module.__dict__[_STATE].earlier = state


def _register_views(module, packed: Tensor, keep_key: bool, requires_grad: bool) -> None:
    E = module.embed_dim
    data = packed.detach()
    present = (True, keep_key, True)
    for index, name in enumerate(BIAS_NAMES):
        view = data[index * E : (index + 1) * E]
        module.register_parameter(name, Parameter(view, requires_grad=requires_grad) if present[index] else None)
    module.__dict__[_STATE] = PackedBias(module, packed, _current_parts(module))


def fused_bias(module) -> Tensor | None:
    """``[b_q; middle; b_v]`` for the fused input projection, from the parameters as they are now.

    Without a graph to record and with the parameters still views of the packed tensor, that tensor
    is the answer and costs nothing. Otherwise one ``cat`` of the parameters (gradients flow to
    them only; the middle slot is detached).
    """
    stand_in = module.__dict__.get(_STAND_IN)
    if stand_in is not None:
        return stand_in
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

    A stand-in (see :func:`assign`) while one is set. Under a trace or a transform, a computed
    tensor. When the parameters cannot be aliased (their memory is managed by someone else:
    ``vector_to_parameters``, FSDP), a :class:`ComputedStockBias`: reading it is exact, writing to
    it or handing it to an optimizer raises, since that would reach nothing.
    """
    stand_in = module.__dict__.get(_STAND_IN)
    if stand_in is not None:
        return stand_in
    # New parameter objects are taken in where their memory is their own (a loader's setattr), as
    # train() does; memory someone else manages (FSDP's) is left alone.
    packed = take_new_parameters(module)
    if packed is not None:
        return packed
    parts = _current_parts(module)
    if _absent(parts):
        return None
    computed = _concatenate(module, module.__dict__.get(_STATE), parts)
    if is_transforming() or type(computed) is not Tensor:  # FakeTensors under Dynamo's call_module
        return computed
    computed = computed.as_subclass(ComputedStockBias)
    copy_loaded_flags(computed, parts)
    return computed


def _sync(module, *, take_new_parameters: bool = False, owned: bool = False) -> Tensor | None:
    """Make the parameters views of the packed tensor again, if needed and allowed; return it or None.

    Only the objects aliased before are re-pointed, unless ``take_new_parameters``; and only those
    whose memory is their own, unless ``owned``. FSDP2 registers unsharded parameters with ``setattr``
    and refills their memory later: re-pointing them would freeze stale values, so they stay where
    they are and the forward builds the bias from them.

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


def resync(module) -> Tensor | None:
    """Take in ``in_proj_bias.data = ...``; re-point only parameter objects aliased before, whose
    memory is their own. Returns the packed tensor, or None where aliasing cannot be made."""
    return _sync(module)


def take_new_parameters(module) -> Tensor | None:
    """As :func:`resync`, and take parameter objects registered since (a loader's ``setattr``), if
    their memory is their own."""
    return _sync(module, take_new_parameters=True)


def reown(module) -> Tensor | None:
    """As :func:`take_new_parameters`, whatever their memory: for objects the module itself just
    registered (``_apply``, loading, unpickling)."""
    return _sync(module, take_new_parameters=True, owned=True)


def is_packed(module, tensor: Tensor) -> bool:
    """Whether ``tensor`` is the packed tensor that ``module.in_proj_bias`` returns."""
    state = module.__dict__.get(_STATE)
    return state is not None and tensor is state.packed


def _owner(packed: Tensor):
    """The module whose live packed tensor ``packed`` is, or None (replaced, or its module is gone)."""
    owner = _OWNERS.get(packed)
    module = owner() if owner is not None else None
    if module is None:
        return None
    state = module.__dict__.get(_STATE)
    return module if state is not None and state.packed is packed else None


def _parts_follow_flag(packed: Tensor) -> None:
    module = _owner(packed)
    if module is not None and not is_transforming():
        _sync_flags(module, module.__dict__[_STATE], _current_parts(module))


def _gather_gradient(module, packed: Tensor) -> Tensor | None:
    """``in_proj_bias.grad``: the parameters' gradients as one ``(3E,)`` tensor their ``.grad`` view.

    The parameters' ``.grad`` are the truth (autograd, DDP and optimizers over ``parameters()`` use
    them); this only makes them views of one tensor again where something replaced them (a first
    backward, ``zero_grad(set_to_none=True)``, ``create_graph``), copying their values.
    """
    if resync(module) is None:
        raise RuntimeError(unaliased_message("reading in_proj_bias.grad (an optimizer or clip_grad_norm_ does)"))
    state = module.__dict__[_STATE]
    parts = _current_parts(module)
    grads = tuple(None if part is None else part.grad for part in parts)
    if all(grad is None for grad in grads):
        state.gradient = None
        return None
    E = module.embed_dim
    gradient = state.gradient
    # Same objects is not enough: casts re-point a .grad's data in place (grad.data = ...).
    if gradient is not None and _same_objects(grads, state.gradient_views) and _views_at(
        grads, gradient.data_ptr(), gradient.element_size(), gradient.dtype, E
    ):
        return gradient
    reference = _first_present(grads)
    gradient = torch.zeros(3 * E, dtype=reference.dtype, device=reference.device)
    with torch.no_grad():
        for index, (part, grad) in enumerate(zip(parts, grads)):
            if grad is not None:
                gradient[index * E : (index + 1) * E].copy_(grad)
                part.grad = gradient[index * E : (index + 1) * E]
    state.gradient = gradient
    state.gradient_views = tuple(None if part is None else part.grad for part in parts)
    return gradient


def _scatter_gradient(module, packed: Tensor, value: Tensor | None) -> None:
    """``in_proj_bias.grad = value``: the parameters' ``.grad`` become views of ``value`` (or None)."""
    if resync(module) is None:
        raise RuntimeError(unaliased_message("assigning in_proj_bias.grad"))
    E = module.embed_dim
    if value is not None and tuple(value.shape) != (3 * E,):  # refused before anything changes
        raise RuntimeError(
            f"assigned grad has data of a different size: in_proj_bias is ({3 * E},), got {tuple(value.shape)}"
        )
    state = module.__dict__[_STATE]
    parts = _current_parts(module)
    _set_grad(packed, None)
    for index, part in enumerate(parts):
        if part is not None:
            part.grad = None if value is None else value[index * E : (index + 1) * E]
    state.gradient = value
    state.gradient_views = tuple(None if part is None else part.grad for part in parts)


# ----------------------------------------------------------------------------------- internals


def _current_parts(module) -> tuple:
    # Straight from the registry (functional_call swaps tensors there too); a parametrized module
    # has moved them out, so fall back to attribute access, which computes them.
    parameters = module._parameters
    try:
        return tuple(parameters[name] for name in BIAS_NAMES)
    except KeyError:
        return tuple(getattr(module, name) for name in BIAS_NAMES)


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
    if state.notifies and is_capturing_graph():
        return state.memory
    return state.packed


def _can_alias(module, parts: tuple, owned: bool = False) -> bool:
    E = module.embed_dim
    reference = _first_present(parts)
    for name, part in zip(BIAS_NAMES, parts):
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
    packed_flag = _get_requires_grad(packed)
    if packed_flag != state.requires_grad:  # requires_grad_ on in_proj_bias: parts follow
        for part in present:
            part.requires_grad_(packed_flag)
    else:
        wanted = any(p.requires_grad for p in present)
        if packed_flag != wanted:
            try:
                torch._C.TensorBase.requires_grad_(packed, wanted)
            except RuntimeError:  # an inference tensor outside inference mode keeps its flag
                pass
    state.requires_grad = _get_requires_grad(packed)
    if packed.requires_grad and not state.hooked:
        packed.register_post_accumulate_grad_hook(_GradientRouter(module))
        state.hooked = True
    copy_loaded_flags(packed, parts)


class _GradientRouter:
    """Gradients that code computing with ``in_proj_bias`` itself accumulates land in the parameters.

    Stock's ``in_proj_bias`` is a ``Parameter``, so ``loss(m.in_proj_bias).backward()`` fills its
    ``.grad``. Here the slices go to ``q_proj_bias``/``v_proj_bias`` (and a kept ``k_proj_bias``)
    instead, where optimizers see them; a dropped key bias has no parameter and gets none.
    """

    def __init__(self, module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, packed: Tensor) -> None:
        grad = _get_grad(packed)
        _set_grad(packed, None)
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
