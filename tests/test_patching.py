"""patch / unpatch / patched / is_patched: what is replaced, what comes back, isinstance, threads."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import types

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import SlimMultiheadAttention, is_patched, patch, patched, unpatch
from slim_mha.patching import PatchedMultiheadAttention

from _reference import STOCK_MHA, assert_close_scaled, randomize_parameters

TORCH_NAMESPACES = (
    "torch.nn",
    "torch.nn.modules",
    "torch.nn.modules.activation",
    "torch.nn.modules.transformer",
)


@pytest.fixture(autouse=True)
def no_patch_leaks():
    """Every test must leave torch unpatched; clean up (and fail) if one does not."""
    assert not is_patched(), "a previous test left torch patched"
    yield
    leaked = is_patched()
    unpatch()
    assert not leaked, "test left torch patched"
    for name in TORCH_NAMESPACES:
        assert sys.modules[name].MultiheadAttention is STOCK_MHA, f"{name} rebound"
    assert type(STOCK_MHA(8, 2)) is STOCK_MHA


@pytest.fixture
def graph_library(monkeypatch):
    """A library imported before patch(), binding the stock class by name and under an alias."""
    module = types.ModuleType("fake_graph_library")
    exec(
        "from torch.nn import MultiheadAttention\n"
        "from torch.nn import MultiheadAttention as StockAttention\n"
        "def build():\n"
        "    return MultiheadAttention(8, 2)\n",
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def bound_classes() -> dict[str, type]:
    return {name: sys.modules[name].MultiheadAttention for name in TORCH_NAMESPACES}


# ------------------------------------------------------------------------------ what is replaced


def test_every_name_stays_torchs_and_every_name_builds_slim_while_patched(graph_library):
    """Construction is redirected, names are not: an import by name, an alias bound before patch()
    and torch's own names all build slim while patched, and stock after."""
    patch()
    assert is_patched()
    assert set(bound_classes().values()) == {STOCK_MHA}  # nothing rebound
    assert graph_library.MultiheadAttention is STOCK_MHA and graph_library.StockAttention is STOCK_MHA
    assert type(graph_library.build()) is PatchedMultiheadAttention
    assert type(graph_library.StockAttention(8, 2)) is PatchedMultiheadAttention
    unpatch()
    assert not is_patched()
    assert type(graph_library.build()) is STOCK_MHA and type(graph_library.StockAttention(8, 2)) is STOCK_MHA


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.parametrize("build", ["encoder_layer", "decoder_layer", "transformer", "nn", "activation"])
def test_everything_torch_builds_is_slim_while_patched(build):
    def attention_modules():
        factories = {
            "encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
            "decoder_layer": lambda: nn.TransformerDecoderLayer(8, 2, dim_feedforward=16),
            "transformer": lambda: nn.Transformer(8, 2, 1, 1, dim_feedforward=16),
            "nn": lambda: torch.nn.MultiheadAttention(8, 2),
            "activation": lambda: torch.nn.modules.activation.MultiheadAttention(8, 2),
        }
        model = factories[build]()
        return [m for m in model.modules() if isinstance(m, STOCK_MHA)]

    with patched():
        built = attention_modules()
    assert built and all(type(m) is PatchedMultiheadAttention for m in built)
    assert all(type(m) is STOCK_MHA for m in attention_modules())


def test_patch_and_unpatch_are_idempotent(graph_library):
    unpatch()  # not patched: nothing to do
    assert type(graph_library.build()) is STOCK_MHA
    patch()
    patch()
    assert is_patched() and type(graph_library.build()) is PatchedMultiheadAttention
    unpatch()  # one unpatch undoes any number of patch() calls
    assert not is_patched() and type(graph_library.build()) is STOCK_MHA
    unpatch()
    assert bound_classes() == dict.fromkeys(TORCH_NAMESPACES, STOCK_MHA)


def test_a_name_imported_inside_a_block_builds_stock_after_it(monkeypatch):
    late = types.ModuleType("imported_while_patched")
    with patched():
        exec("from torch.nn import MultiheadAttention", late.__dict__)
        assert type(late.MultiheadAttention(8, 2)) is PatchedMultiheadAttention
    assert late.MultiheadAttention is STOCK_MHA and type(late.MultiheadAttention(8, 2)) is STOCK_MHA


def test_patch_refuses_when_another_library_patched_torch(monkeypatch, graph_library):
    class OtherAttention(nn.Module):
        pass

    monkeypatch.setattr(torch.nn, "MultiheadAttention", OtherAttention)
    with pytest.raises(RuntimeError, match=r"torch\.nn\.MultiheadAttention is .*OtherAttention.*not torch's stock"):
        patch()
    with pytest.raises(RuntimeError, match="another library has patched it"):
        with patched():
            pass
    assert not is_patched()
    assert type(graph_library.build()) is STOCK_MHA  # nothing was half-installed


def test_patch_refuses_when_another_library_owns_stocks_constructor(monkeypatch):
    def theirs(cls, *args, **kwargs):
        return object.__new__(cls)

    monkeypatch.setattr(STOCK_MHA, "__new__", staticmethod(theirs), raising=False)
    with pytest.raises(RuntimeError, match=r"torch's MultiheadAttention has a __new__ of another library's"):
        patch()
    assert not is_patched()


# ------------------------------------------------------------------------------ composition


def test_patched_blocks_nest_and_compose_with_patch():
    with patched():
        with patched():
            assert is_patched()
        assert is_patched(), "the inner block must not unpatch the outer one"
    assert not is_patched()

    patch()
    with patched():
        pass
    assert is_patched(), "a block must not undo an explicit patch()"
    unpatch()
    assert not is_patched()

    with patched():
        unpatch()  # releases patch()'s hold only; the open block still holds the patch
        assert is_patched()
    assert not is_patched()


def test_patched_restores_on_exception_and_works_as_decorator():
    with pytest.raises(KeyError):
        with patched():
            raise KeyError("boom")
    assert not is_patched()

    @patched()
    def build():
        return nn.MultiheadAttention(8, 2)

    assert type(build()) is PatchedMultiheadAttention
    assert not is_patched()


def test_patching_is_thread_safe():
    """Blocks in many threads, with patch()/unpatch() toggled meanwhile: every block sees slim.

    A short switch interval makes threads interleave inside the critical sections; without the
    lock this fails (blocks see stock, or patch() finds our own class half-installed and refuses).
    """
    failures: list[str] = []
    start = threading.Barrier(7)

    def use_blocks():
        start.wait()
        for _ in range(40):
            with patched():
                built = nn.TransformerEncoderLayer(4, 1, dim_feedforward=4).self_attn
                if not isinstance(built, SlimMultiheadAttention) or not is_patched():
                    failures.append(f"built {type(built).__name__} inside a patched() block")

    def toggle():
        start.wait()
        for _ in range(40):
            patch()
            unpatch()

    def recording(body):
        def run():
            try:
                body()
            except Exception as error:  # a thread's exception would not fail the test by itself
                failures.append(repr(error))

        return run

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=recording(use_blocks)) for _ in range(5)]
        threads += [threading.Thread(target=recording(toggle)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads), "a thread hung (lock never released?)"
    assert not failures, failures[:3]
    assert not is_patched()
    assert bound_classes() == dict.fromkeys(TORCH_NAMESPACES, STOCK_MHA)
    assert type(nn.MultiheadAttention(8, 2)) is STOCK_MHA


# ------------------------------------------------------------------------------ isinstance


def test_isinstance_holds_for_modules_built_before_during_and_after_patching():
    stock_before = STOCK_MHA(8, 2)
    plain_slim = SlimMultiheadAttention(8, 2)
    with patched():
        built_while_patched = nn.MultiheadAttention(8, 2)
        attention_modules = (stock_before, plain_slim, built_while_patched)
        for module in attention_modules:
            assert isinstance(module, torch.nn.MultiheadAttention), type(module)
            assert isinstance(module, torch.nn.modules.transformer.MultiheadAttention), type(module)
            assert isinstance(module, STOCK_MHA), type(module)
        assert issubclass(STOCK_MHA, torch.nn.MultiheadAttention)
        assert issubclass(SlimMultiheadAttention, torch.nn.MultiheadAttention)
        assert not isinstance(nn.Linear(2, 2), torch.nn.MultiheadAttention)
        assert not issubclass(nn.Linear, torch.nn.MultiheadAttention)
        assert type(stock_before) is torch.nn.MultiheadAttention  # the name is stock's
        assert type(built_while_patched) is not torch.nn.MultiheadAttention  # exact-type checks do differ
    stock_after = nn.MultiheadAttention(8, 2)
    for module in (*attention_modules, stock_after):
        assert isinstance(module, torch.nn.MultiheadAttention), type(module)
    assert type(stock_after) is STOCK_MHA


def test_a_class_defined_while_patched_is_the_users_on_stocks_base():
    """No metaclass of slim's: a user's metaclass combines, and the class builds what it builds unpatched."""

    class Meta(type):
        pass

    with patched():

        class UserAttention(nn.MultiheadAttention):
            pass

        class WithMeta(nn.MultiheadAttention, metaclass=Meta):
            pass

        assert type(UserAttention(8, 2)) is UserAttention and type(WithMeta(8, 2)) is WithMeta
    assert UserAttention.__bases__ == (STOCK_MHA,) and type(WithMeta) is Meta
    assert not issubclass(UserAttention, SlimMultiheadAttention)


# ------------------------------------------------------------------------------ the modules built


def test_modules_built_while_patched_compute_stock_and_pickle_as_stock():
    torch.manual_seed(0)
    stock = randomize_parameters(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0))
    with patched():
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
    layer.load_state_dict(stock.state_dict(), strict=True)
    x = torch.randn(5, 3, 8)
    assert_close_scaled(layer(x), stock(x))

    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # unpatched here: stock's classes
    assert type(loaded) is type(stock) and type(loaded.self_attn) is STOCK_MHA
    assert_close_scaled(loaded(x), stock(x))
    buffer.seek(0)
    with patched():  # in a patched process the same file builds slim
        loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.self_attn) is PatchedMultiheadAttention
    assert_close_scaled(loaded(x), stock(x))


def test_public_api_is_exported():
    for name in ("patch", "unpatch", "patched", "is_patched", "convert", "to_stock", "fold_value_bias"):
        assert name in slim_mha.__all__ and callable(getattr(slim_mha, name))


@pytest.mark.parametrize(
    "first",
    ["import slim_mha", "import slim_mha.conversion", "import slim_mha.migration.cli", "from slim_mha import *"],
)
def test_package_names_are_the_documented_objects_whatever_is_imported_first(first):
    # The package binds its names on first use (so the migration CLI can import torch inside its
    # Ctrl-C guard); no submodule shares a name with a public function, whatever is imported first.
    probe = f"""
import sys
{first}
torch_before = 'torch' in sys.modules
import slim_mha, slim_mha.conversion, types
assert callable(slim_mha.convert), slim_mha.convert
import pkgutil
submodules = {{info.name for info in pkgutil.iter_modules(slim_mha.__path__)}}
assert not submodules & set(slim_mha.__all__), submodules & set(slim_mha.__all__)
assert slim_mha.SlimMultiheadAttention.__module__ == 'slim_mha.attention'
for name in slim_mha.__all__:  # every public name is the object a submodule defines, never a submodule
    value = getattr(slim_mha, name)
    assert not isinstance(value, types.ModuleType) and value.__module__.startswith('slim_mha.'), (name, value)
print(torch_before)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # `import slim_mha` alone no longer costs the torch import; the CLI module itself imports it lazily
    if first in ("import slim_mha", "import slim_mha.migration.cli"):
        assert done.stdout.strip() == "False"


def test_unknown_package_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = slim_mha.no_such_name
