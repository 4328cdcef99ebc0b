"""``recording_attention`` and ``explain``: maps from any model without editing it, and each call's path.

The maps are compared with what stock's own module returns with ``need_weights=True`` on the same
inputs and weights, within stock's rounding; the outputs with the block open are the outputs without it.
"""

import copy

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha import encoder_layer, inspection
from slim_mha._torch_compat import STOCK_ENCODER_LAYER, STOCK_MHA

E, H, FF, B = 32, 4, 64, 3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors' prototype warning


def encoders(*, nested: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    stock = nn.TransformerEncoder(
        STOCK_ENCODER_LAYER(E, H, FF, dropout=0.1, batch_first=True), 2, enable_nested_tensor=nested
    )
    with slim_mha.patched():
        slim = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=True), 2, enable_nested_tensor=nested
        )
    slim.load_state_dict(stock.state_dict())
    return stock.eval(), slim.eval()


def padded_batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(B, length, E, generator=torch.Generator().manual_seed(length))
    padding = torch.zeros(B, length, dtype=torch.bool)
    padding[1, length - 3 :] = True
    padding[2, length // 2 :] = True
    return x, padding


def stock_maps(stock: nn.Module, x: torch.Tensor, padding, per_head: bool) -> list[torch.Tensor]:
    """Each layer's weights from stock's own attention module, layer by layer (post-norm layers)."""
    maps = []
    with torch.no_grad():
        for layer in stock.layers:
            _, weights = layer.self_attn(x, x, x, key_padding_mask=padding, average_attn_weights=not per_head)
            maps.append(weights)
            x = layer(x, src_key_padding_mask=padding)
            if x.is_nested:
                x = x.to_padded_tensor(0.0)
    return maps


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("length", [16, 400])  # below and above every fused-layer threshold
def test_an_encoders_maps_are_stocks_weights_and_its_outputs_do_not_change(per_head, nested, length):
    stock, slim = encoders(nested=nested)
    x, padding = padded_batch(length)
    with torch.no_grad():
        before = slim(x, src_key_padding_mask=padding)
        with slim_mha.recording_attention(slim, per_head=per_head) as maps:
            during = slim(x, src_key_padding_mask=padding)
    dense = (lambda t: t.to_padded_tensor(0.0)) if before.is_nested else (lambda t: t)
    torch.testing.assert_close(dense(during), dense(before), rtol=1e-5, atol=1e-5)
    assert list(maps) == ["layers.0.self_attn", "layers.1.self_attn"]
    expected = stock_maps(stock, x, padding, per_head)
    rows = padding[:, None, :, None] if per_head else padding[:, :, None]
    for name, reference in zip(maps, expected):
        (recorded,) = maps[name]
        assert recorded.shape == ((B, H, length, length) if per_head else (B, length, length))
        assert not recorded.requires_grad and recorded.grad_fn is None
        if nested:  # padded query rows are padded as the output is: zero
            assert torch.count_nonzero(recorded.masked_select(rows.expand_as(recorded))) == 0
            reference = reference.masked_fill(rows, 0.0)
        torch.testing.assert_close(recorded, reference, rtol=1e-5, atol=1e-6)
        assert (
            torch.count_nonzero(
                recorded.masked_select(
                    padding[:, None, None, :].expand(B, H, length, length)
                    if per_head
                    else padding[:, None, :].expand(B, length, length)
                )
            )
            == 0
        )


@pytest.mark.parametrize("how", ["patched", "converted", "imported"])
def test_maps_from_a_bare_module_in_every_way_slim_is_made(how):
    torch.manual_seed(0)
    stock = STOCK_MHA(E, H, batch_first=True).eval()
    if how == "patched":
        with slim_mha.patched():
            slim = nn.MultiheadAttention(E, H, batch_first=True)
    elif how == "converted":
        slim = slim_mha.convert(copy.deepcopy(stock))
    else:
        slim = slim_mha.SlimMultiheadAttention(E, H, batch_first=True)
    slim.load_state_dict(stock.state_dict())
    slim.eval()
    q, kv = torch.randn(2, 7, E), torch.randn(2, 9, E)
    with torch.no_grad(), slim_mha.recording_attention(slim) as maps:
        out, weights = slim(q, kv, kv, need_weights=False)
        unbatched = slim(q[0], kv[0], kv[0], need_weights=True, average_attn_weights=False)[1]
    assert weights is None and unbatched.shape == (H, 7, 9)
    expected = stock(q, kv, kv)[1], stock(q[0], kv[0], kv[0])[1]
    assert list(maps) == ["(the model)"] and len(maps["(the model)"]) == 2
    for recorded, reference in zip(maps["(the model)"], expected):
        torch.testing.assert_close(recorded, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, stock(q, kv, kv, need_weights=False)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("average", [False, True])
def test_in_training_recording_changes_no_output_and_no_draw(need_weights, average):
    """The call runs as it would unrecorded: its output, weights, gradients and the RNG after it are
    those of the same seeded call outside the block, bit for bit. The maps are the returned weights
    (after dropout) where the caller asked for them, else every head's probabilities without dropout."""
    torch.manual_seed(0)
    slim = slim_mha.SlimMultiheadAttention(E, H, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 50, E)

    def step():
        torch.manual_seed(1)
        leaf = x.clone().requires_grad_()
        out, weights = slim(leaf, leaf, leaf, need_weights=need_weights, average_attn_weights=average)
        out.sum().backward()
        return out, weights, leaf.grad, torch.rand(3)

    unrecorded = step()
    with slim_mha.recording_attention(slim, per_head=True) as maps:
        recorded = step()
    for a, b in zip(unrecorded, recorded):
        assert (a is None and b is None) or torch.equal(a, b)
    (heads,) = maps["(the model)"]
    assert heads.shape == (2, H, 50, 50)
    if need_weights and not average:
        assert torch.equal(heads, recorded[1].detach()) and (heads == 0).any()  # after dropout
    else:
        torch.testing.assert_close(heads.sum(-1), torch.ones(2, H, 50))  # probabilities, no dropout


def test_no_state_is_left_after_a_block_that_raised_and_blocks_nest():
    _, slim = encoders(nested=False)
    x, padding = padded_batch(16)
    with pytest.raises(RuntimeError, match="the user's"):
        with slim_mha.recording_attention(slim):
            raise RuntimeError("the user's error")
    assert inspection.RECORDING == [] and inspection.EXPLAINING == []
    with torch.no_grad(), slim_mha.recording_attention(slim) as outer:
        slim(x)
        with slim_mha.recording_attention(slim.layers[1], per_head=True) as inner:
            slim(x)
        slim(x)
    assert [len(v) for v in outer.values()] == [3, 3] and [len(v) for v in inner.values()] == [1]
    assert inner["self_attn"][0].shape == (B, H, 16, 16)
    assert inspection.RECORDING == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in slim.modules())
    calls = {"fused": 0}
    fused = torch._transformer_encoder_layer_fwd
    try:
        torch._transformer_encoder_layer_fwd = lambda *a: calls.update(fused=calls["fused"] + 1) or fused(*a)
        with torch.no_grad():
            slim(x)  # after the block, short calls take stock's fused kernel again
    finally:
        torch._transformer_encoder_layer_fwd = fused
    assert calls["fused"] == 2


def test_a_stock_model_is_refused_with_the_fix():
    stock, _ = encoders(nested=False)
    for entry in (
        lambda: slim_mha.recording_attention(stock).__enter__(),
        lambda: slim_mha.explain(stock, torch.randn(1, 4, E)),
    ):
        with pytest.raises(ValueError, match=r"holds no slim attention module.*patch\(\).*convert\(model\)"):
            entry()
    assert inspection.RECORDING == []


@pytest.mark.parametrize("per_head", [False, True])
def test_maps_too_large_are_refused_before_they_are_allocated_naming_the_module(monkeypatch, per_head):
    """The advice is the recording's: the caller's need_weights=False is not the cause."""
    from slim_mha import _explicit_attention as guard

    _, slim = encoders(nested=False)
    monkeypatch.setattr(guard, "available_bytes", lambda device: (1 << 20, "a test's limit"))
    monkeypatch.setattr(guard, "_CHECK_ABOVE_BYTES", 0)  # every size is checked
    x, _ = padded_batch(400)
    with pytest.raises(
        torch.OutOfMemoryError, match=r"recording_attention: module layers\.0\.self_attn: its maps, .* need at least"
    ) as caught:
        with torch.no_grad(), slim_mha.recording_attention(slim, per_head=per_head):
            slim(x)
    message = str(caught.value)
    assert "need_weights=False" not in message and message.endswith("attend over fewer tokens")
    assert ("per_head=False" in message) == per_head
    assert inspection.RECORDING == []


def test_explain_tells_the_encoder_layers_paths_apart_and_names_dropout_in_training():
    _, slim = encoders(nested=False)
    with torch.no_grad():
        short = slim_mha.explain(slim, torch.randn(B, 16, E))
        long = slim_mha.explain(slim, torch.randn(B, 400, E))
    layer_rows = lambda report: [(row.module, row.path) for row in report if row.kind == "encoder layer"]
    assert layer_rows(short) == [("layers.0", "stock fused layer"), ("layers.1", "stock fused layer")]
    assert "16 tokens" in short[0].why
    assert layer_rows(long) == [("layers.0", "slim layer"), ("layers.1", "slim layer")]
    assert [row.path for row in long if row.kind == "attention"] == ["sdpa", "sdpa"]
    slim.train()
    with torch.no_grad():
        trained = slim_mha.explain(slim, torch.randn(B, 16, E))
    attention = [row for row in trained if row.kind == "attention"]
    assert [row.why for row in attention] == ["attention dropout", "attention dropout"]
    assert trained[0].why == "training is enabled"
    table = str(trained)
    assert table.splitlines()[0].split() == ["module", "kind", "path", "why"] and "attention dropout" in table
    assert trained.census()[("attention", "general", "attention dropout")] == 2


def test_explain_agrees_with_the_one_owner_of_the_choice():
    """Every row is choose_path's or layer_path's own answer for that call."""
    slim = slim_mha.SlimMultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 8, E)
    from slim_mha._stock_checks import AttentionCall
    from slim_mha.paths import PATHS_TAKEN, choose_path

    with torch.no_grad():
        (row,) = slim_mha.explain(slim, x, x, x)
        path, why = choose_path(slim, AttentionCall(x, x, x, None, True, None, True, False))[:2]
        assert (row.path, row.why) == (path, why or PATHS_TAKEN[path])  # a short path: what it is
    assert row.module == "(the model)" and row.kind == "attention"
    assert encoder_layer.layer_path  # the layer's rows come from it (test above)


@pytest.mark.parametrize("model", ["small", "vit_b_16"])
def test_a_torchvision_vit_gives_stocks_weights_for_attention_rollout(model):
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    if model == "vit_b_16":  # built from its config: no weights are downloaded
        stock, images = models.vit_b_16().eval(), torch.randn(1, 3, 224, 224)
    else:
        stock = models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=32, mlp_dim=64
        )
        stock, images = stock.eval(), torch.randn(2, 3, 32, 32)
    slim = slim_mha.convert(copy.deepcopy(stock))
    inputs = []
    hooks = [
        block.self_attention.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        for block in stock.encoder.layers
    ]
    with torch.no_grad():
        expected_out = stock(images)
    for hook in hooks:
        hook.remove()
    for per_head in (False, True):
        with torch.no_grad(), slim_mha.recording_attention(slim, per_head=per_head) as maps:
            torch.testing.assert_close(slim(images), expected_out, rtol=1e-5, atol=1e-5)
        assert len(maps) == len(stock.encoder.layers) == (12 if model == "vit_b_16" else 3)
        for (recorded,), block, x in zip(maps.values(), stock.encoder.layers, inputs):
            reference = block.self_attention(x, x, x, average_attn_weights=not per_head)[1]
            torch.testing.assert_close(recorded, reference, rtol=1e-5, atol=1e-6)
