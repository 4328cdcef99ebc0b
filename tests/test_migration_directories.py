"""Whole model folders: the companion files (config.json, tokenizer files, README...) come along byte
for byte, are listed in the report, can be left out, and a rerun with --force over such an output
works. Also: loading a --fold-value-bias checkpoint exactly as the README says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import slim_mha
from slim_mha.migration import fold_checkpoint, format_report, strip_checkpoint
from slim_mha.migration.cli import main

from _migration_checkpoints import (
    STOCK_MHA,
    prefixed,
    randomize,
    save_sharded,
    stock_attention,
    tree_digest,
)
from _migration_helpers import private_ledger  # noqa: F401 (autouse)
from _reference import assert_close_scaled

COMPANIONS = {
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "README.md": "# A model\n\nCafé \u2014 with UTF-8 and a trailing space \n".encode(),
    "config.json": b'{"model_type": "test", "hidden_size": 8}\n',
    "generation_config.json": b'{"max_new_tokens": 4}',
    "merges.txt": b"#version: 0.2\nh e\n",
    "special_tokens_map.json": b'{"eos_token": "</s>"}',
    "tokenizer.json": bytes(range(256)) * 3,  # any bytes: copied, never parsed
    "tokenizer_config.json": b"{}",
    "vocab.txt": b"",  # empty files too
}
SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _hf_folder(folder: Path) -> Path:
    tensors = {
        **prefixed(stock_attention(seed=1), "encoder.attn."),
        **prefixed(stock_attention(seed=2), "decoder.attn."),
    }
    save_sharded(
        tensors, folder, [[key for key in tensors if key.startswith(prefix)] for prefix in ("decoder.", "encoder.")]
    )
    for name, data in COMPANIONS.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def model_folder(tmp_path) -> Path:
    return _hf_folder(tmp_path / "model")


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in os.listdir(folder)}


def test_companions_are_copied_byte_for_byte_and_listed(tmp_path, model_folder):
    before = tree_digest(model_folder)
    report = fold_checkpoint(model_folder, tmp_path / "out")
    copied = _files(tmp_path / "out")
    assert {name: copied[name] for name in COMPANIONS} == COMPANIONS
    assert sorted(copied) == sorted([*COMPANIONS, *SHARD_NAMES, "model.safetensors.index.json"])
    assert report.companions == tuple(sorted(COMPANIONS))
    assert format_report(report).splitlines()[-2] == (
        "copied 9 companion files unchanged: " + ", ".join(sorted(COMPANIONS))
    )
    assert tree_digest(model_folder) == before


def test_weights_subfolders_and_special_files_are_left_out_and_said(tmp_path, model_folder):
    torch.save(prefixed(stock_attention(), "attn."), model_folder / "pytorch_model.bin")  # unconverted weights
    (model_folder / "training_args.bin").write_bytes(b"\x80\x04pickle")
    (model_folder / "onnx").mkdir()
    (model_folder / "onnx" / "model.onnx").write_bytes(b"onnx")
    os.mkfifo(model_folder / "pipe")  # reading it would block: it is never opened
    os.symlink(model_folder / "missing", model_folder / "dangling")
    report = fold_checkpoint(model_folder, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == sorted([*COMPANIONS, *SHARD_NAMES, "model.safetensors.index.json"])
    assert report.notes == (
        "did not copy dangling: a broken symbolic link",
        "did not copy onnx/: a subdirectory (only the folder's own files are copied)",
        "did not copy pipe: not a regular file",
        "did not copy pytorch_model.bin: a weight file this run does not convert",
        "did not copy training_args.bin: a weight file this run does not convert",
    )


def _hub_snapshot(model_folder: Path, repository: Path) -> Path:
    """The Hugging Face cache layout: ``snapshots/<rev>/NAME -> ../../blobs/<hash>``, shards and companions alike."""
    blobs, snapshot = repository / "blobs", repository / "snapshots" / ("ab" * 20)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, name in enumerate(sorted(os.listdir(model_folder))):
        (model_folder / name).rename(blobs / f"{number:064x}")
        os.symlink(f"../../blobs/{number:064x}", snapshot / name)
    return snapshot


def test_companions_reached_through_symlinks_are_copied_as_files(tmp_path, model_folder):
    """A Hugging Face cache snapshot links into its repository's blobs/: those files are SRC's own."""
    snapshot = _hub_snapshot(model_folder, tmp_path / "hub" / "models--org--name")
    blobs = snapshot.parents[1] / "blobs"
    blobs_before = tree_digest(blobs)
    report = fold_checkpoint(snapshot, tmp_path / "out")
    out = tmp_path / "out"
    assert not any((out / name).is_symlink() for name in os.listdir(out))
    assert {name: (out / name).read_bytes() for name in COMPANIONS} == COMPANIONS
    assert tree_digest(blobs) == blobs_before and report.notes == ()


def test_a_snapshot_linking_into_another_repository_is_outside(tmp_path, model_folder):
    snapshot = _hub_snapshot(model_folder, tmp_path / "hub" / "models--org--name")
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    (other / "secret").write_bytes(b"not this model's")
    os.symlink(other / "secret", snapshot / "notes.txt")
    report = fold_checkpoint(snapshot, tmp_path / "out")
    assert not (tmp_path / "out" / "notes.txt").exists()
    assert report.notes == (
        f"did not copy notes.txt: a symbolic link that leads outside SRC, to {other / 'secret'} "
        "(follow_outside_links=True copies it)",
    )


def test_no_companions_leaves_them_out(tmp_path, model_folder):
    report = fold_checkpoint(model_folder, tmp_path / "out", companions=False)
    assert sorted(os.listdir(tmp_path / "out")) == sorted([*SHARD_NAMES, "model.safetensors.index.json"])
    assert report.companions == ()
    assert report.notes == ("did not copy 9 companion files (companions=False)",)


def test_cli_no_companions_and_the_report(tmp_path, model_folder, capsys):
    code = main(["fold", str(model_folder), str(tmp_path / "out"), "--no-companions"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == "note: did not copy 9 companion files (--no-companions)"
    assert not (tmp_path / "out" / "config.json").exists()


def test_rerun_with_force_over_an_output_with_companions(tmp_path, model_folder):
    out = tmp_path / "out"
    fold_checkpoint(model_folder, out)
    (model_folder / "config.json").write_bytes(b'{"model_type": "edited"}')
    fold_checkpoint(model_folder, out, force=True)
    assert (out / "config.json").read_bytes() == b'{"model_type": "edited"}'


def test_companions_copied_in_by_hand_then_force(tmp_path, model_folder):
    """The issue's case: an output made without companions, the user copies them in, reruns with --force."""
    out = tmp_path / "out"
    fold_checkpoint(model_folder, out, companions=False)
    for name in COMPANIONS:
        (out / name).write_bytes((model_folder / name).read_bytes())
    fold_checkpoint(model_folder, out, force=True)
    assert {name: (out / name).read_bytes() for name in COMPANIONS} == COMPANIONS


def test_force_without_companions_over_them_refuses(tmp_path, model_folder):
    out = tmp_path / "out"
    fold_checkpoint(model_folder, out)
    before = tree_digest(out)
    with pytest.raises(
        ValueError, match=r"force=True would delete '\.gitattributes', which this output does not write"
    ):
        fold_checkpoint(model_folder, out, force=True, companions=False)
    assert tree_digest(out) == before


def test_dry_run_lists_them_and_writes_nothing(tmp_path, model_folder):
    report = fold_checkpoint(model_folder, tmp_path / "out", dry_run=True)
    assert report.companions == tuple(sorted(COMPANIONS))
    assert "would copy 9 companion files unchanged: " in format_report(report)
    assert not (tmp_path / "out").exists()


def test_a_folder_with_one_model_safetensors_copies_them_too(tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    save_file(prefixed(stock_attention(), "attn."), folder / "model.safetensors")
    (folder / "config.json").write_bytes(b"{}")
    report = strip_checkpoint(folder, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert report.companions == ("config.json",)


def test_a_single_file_source_writes_a_single_file(tmp_path, model_folder):
    """SRC given as one .safetensors file: the output is that one file; nothing else is copied."""
    save_file(prefixed(stock_attention(), "attn."), model_folder / "extra.safetensors")
    report = fold_checkpoint(model_folder / "extra.safetensors", tmp_path / "out.safetensors")
    assert report.companions == () and sorted(os.listdir(tmp_path)) == ["model", "out.safetensors"]


# ---------------------------------------------------------------------------------- loading a value-bias fold


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = STOCK_MHA(8, 2, add_bias_kv=True)
        self.head = nn.Linear(8, 3)


def test_a_fold_value_bias_checkpoint_loads_into_stock_and_slim_models(tmp_path):
    """fold --fold-value-bias writes stock's layout with zero key and value slots: a stock model and a
    converted one both load it (strict) and compute the original model's outputs in eval mode."""
    stock = randomize(_Model(), seed=4).eval()
    save_file({key: value.contiguous() for key, value in stock.state_dict().items()}, tmp_path / "stock.safetensors")
    fold_checkpoint(tmp_path / "stock.safetensors", tmp_path / "eval.safetensors", fold_value_bias=True)
    state = load_file(tmp_path / "eval.safetensors")
    assert state.keys() == stock.state_dict().keys()

    query = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = stock.attn(query, query, query)
    for model in (_Model(), slim_mha.convert(_Model())):
        model.load_state_dict(state)  # strict
        with torch.no_grad():
            actual, _ = model.eval().attn(query, query, query)
        assert_close_scaled(actual, expected, type(model.attn).__name__)
