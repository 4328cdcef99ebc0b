"""The migration for the people who run it: honest sizes, idempotent reports, a CLI that does what cp
would, and the same conversions on a state dict held in memory."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import slim_mha
from slim_mha.migration import (
    fold_checkpoint,
    fold_state_dict,
    strip_checkpoint,
    strip_state_dict,
    to_stock_state_dict,
)
from slim_mha.migration._torch_pickles import torch_reads_pickles_safely

from _migration_helpers import private_ledger, reads_pickles, refusal, run_cli  # noqa: F401 (private_ledger: autouse)

E = 64


def layer(seed: int = 0) -> nn.Module:
    """The README's encoder layer, with a key bias that is not zero (a trained model's)."""
    torch.manual_seed(seed)
    module = nn.TransformerEncoderLayer(E, 4, 128, batch_first=True)
    with torch.no_grad():
        module.self_attn.in_proj_bias.normal_()
    return module.eval()


@pytest.fixture
def layer_file(tmp_path):
    path = tmp_path / "layer.safetensors"
    save_file(layer().state_dict(), path)
    return path


def _header_padding(path) -> int:
    """Spaces after the JSON header: what the writer added beyond the format's own 8-byte alignment."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length]
    return len(header) - len(header.rstrip(b" "))


def test_strip_writes_a_smaller_file_and_pads_the_header_no_more_than_the_format_needs(tmp_path, layer_file):
    stripped, folded = tmp_path / "layer.slim.safetensors", tmp_path / "layer.folded.safetensors"
    strip_checkpoint(layer_file, stripped)
    fold_checkpoint(layer_file, folded)
    assert stripped.stat().st_size < layer_file.stat().st_size  # E floats dropped, a few header bytes added
    assert _header_padding(stripped) < 8 and _header_padding(folded) < 8


def test_fold_with_the_key_slots_already_zero_has_nothing_to_do_as_strip_does(tmp_path, layer_file, capsys):
    folded = tmp_path / "folded.safetensors"
    assert run_cli(["fold", layer_file, folded], capsys)[0] == 0
    code, out, err = run_cli(["fold", folded, tmp_path / "again.safetensors"], capsys)
    assert (code, out) == (
        3,
        "",
    ) and "nothing to do: its attention module 'self_attn' has its key slot at zero already" in err
    stripped = tmp_path / "stripped.safetensors"
    assert run_cli(["strip", layer_file, stripped], capsys)[0] == 0
    assert (
        run_cli(["strip", stripped, tmp_path / "again.safetensors"], capsys)[0] == 3
    )  # the same status: nothing to do
    assert not (tmp_path / "again.safetensors").exists()


@pytest.mark.parametrize("name", ["weights.safetensors", "model.pt"])
def test_a_folder_holding_one_checkpoint_under_any_name_is_a_source(tmp_path, name):
    if name.endswith(".pt") and not torch_reads_pickles_safely():
        pytest.skip("pickle-based inputs need a torch release >= 2.10.0")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    state = layer().state_dict()
    (save_file if name.endswith(".safetensors") else lambda s, p: torch.save(s, p))(state, folder / name)
    (folder / "config.json").write_text("{}")
    report = fold_checkpoint(folder, tmp_path / "out")
    written = sorted(os.listdir(tmp_path / "out"))
    assert written == ["config.json", "weights.safetensors" if name.startswith("weights") else "model.safetensors"]
    assert report.companions == ("config.json",)
    (folder / "other.safetensors").write_bytes((tmp_path / "out" / written[1]).read_bytes())
    assert "holds 2 weight files" in refusal(ValueError, fold_checkpoint, folder, tmp_path / "out2")


def test_a_dst_folder_for_a_single_file_receives_it_under_the_sources_name(tmp_path, layer_file, capsys):
    (tmp_path / "out").mkdir()
    assert run_cli(["strip", layer_file, tmp_path / "out"], capsys)[0] == 0
    assert os.listdir(tmp_path / "out") == ["layer.safetensors"]


def test_a_dry_run_previews_into_a_folder_not_made_yet_and_over_an_output_with_force(tmp_path, layer_file, capsys):
    code, out, _ = run_cli(["fold", layer_file, tmp_path / "new" / "x.safetensors", "--dry-run"], capsys)
    assert (
        code == 0 and "dry run: would write" in out and "new does not exist yet: create it before the real run" in out
    )
    assert not (tmp_path / "new").exists()
    done = tmp_path / "done.safetensors"
    assert run_cli(["fold", layer_file, done], capsys)[0] == 0
    before = done.read_bytes()
    code, out, _ = run_cli(["fold", layer_file, done, "--dry-run", "--force"], capsys)
    assert code == 0 and "nothing was written" in out and done.read_bytes() == before


def test_a_dst_that_holds_the_source_names_the_real_conflict(tmp_path, monkeypatch):
    folder = tmp_path / "hf_sharded"
    folder.mkdir()
    save_file(layer().state_dict(), folder / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    message = refusal(ValueError, fold_checkpoint, "hf_sharded", ".")
    assert "DST holds the input hf_sharded" in message and "would overwrite" not in message


def test_version_and_a_misspelled_option_show_the_subcommands_usage(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"slim-mha-migrate {slim_mha.__version__}"
    code, _, err = run_cli(["fold", "a.safetensors", "b.safetensors", "--verfy"], capsys)
    assert code == 2 and err.startswith("usage: slim-mha-migrate fold")
    assert "unrecognized arguments: --verfy (did you mean --verify?)" in err


def test_counts_and_articles_read_as_english(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(layer().state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    code, out, _ = run_cli(["fold", folder, tmp_path / "out", "--no-companions"], capsys)
    assert code == 0 and "did not copy 1 companion file (--no-companions)" in out


# ------------------------------------------------------------------------------------ in memory


def test_state_dicts_convert_in_memory_as_files_do_and_the_input_is_untouched():
    stock = layer()
    state = stock.state_dict()
    before = {key: tensor.clone() for key, tensor in state.items()}
    folded, stripped = fold_state_dict(state), strip_state_dict(state)
    back = to_stock_state_dict(stripped)
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
    assert folded is not state and not torch.any(folded["self_attn.in_proj_bias"][E : 2 * E])
    assert "self_attn.in_proj_bias" not in stripped and {"self_attn.q_proj_bias", "self_attn.v_proj_bias"} <= set(
        stripped
    )
    assert folded["linear1.weight"] is state["linear1.weight"]  # what the mode leaves alone is the input's own
    x = torch.randn(2, 7, E)
    expected = stock(x)
    for tensors, patched in ((folded, False), (stripped, True), (back, False)):
        with slim_mha.patched() if patched else torch.no_grad():
            module = nn.TransformerEncoderLayer(E, 4, 128, batch_first=True).eval()
        module.load_state_dict(tensors, strict=True)
        torch.testing.assert_close(module(x), expected)


def test_state_dicts_take_the_files_checks():
    with pytest.raises(ValueError, match=r"state_dict\['step'\] is an int, not a tensor"):
        fold_state_dict({"step": 3})
    attention = nn.MultiheadAttention(E, 4, add_bias_kv=True)
    with pytest.raises(
        ValueError, match=r"bias_k is present .* use fold, which folds it into bias_k; the state dict was not changed"
    ):
        strip_state_dict(attention.state_dict())
    with pytest.raises(ValueError, match="matches no attention module"):
        fold_state_dict(attention.state_dict(), zero_attn=["decoder.*"])


@reads_pickles
def test_the_readmes_layer_reports_a_change_with_an_error(tmp_path, layer_file, capsys):
    """With a key bias that is not zero, fold changes the module and --verify measures it."""
    code, out, _ = run_cli(["fold", layer_file, tmp_path / "f.safetensors", "--verify"], capsys)
    assert code == 0 and "self_attn: zero the key slot of in_proj_bias [verified, error" in out
    assert load_file(tmp_path / "f.safetensors")["self_attn.in_proj_bias"][E : 2 * E].abs().max() == 0


def test_every_keyword_of_the_public_functions_is_an_option_they_pass_on():
    """The public functions hand their keyword arguments to MigrationOptions by name: none is lost."""
    import dataclasses
    import inspect

    import slim_mha.migration as migration
    from slim_mha.migration._migrate import MigrationOptions

    fields = {field.name for field in dataclasses.fields(MigrationOptions)}
    for function in (migration.strip_checkpoint, migration.fold_checkpoint, migration.to_stock_checkpoint):
        keywords = [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert keywords and set(keywords) <= fields, function.__name__
