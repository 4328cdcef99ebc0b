"""migration refuses bad inputs with one pinned message each, and never leaves a partial output."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import slim_mha.migration._output as output_module
import slim_mha.migration._writer as migration_writer
import slim_mha.migration._writer as writer_module
from slim_mha.migration import (
    fold_checkpoint,
    inspect_checkpoint,
    strip_checkpoint,
    to_stock_checkpoint,
)

from _migration_checkpoints import (
    key_bias_free,
    prefixed,
    save_sharded,
    stock_attention,
    tree_digest,
)
from _migration_helpers import old_output, private_ledger, reads_pickles, refusal  # noqa: F401 (private_ledger: autouse)

FIX_GROUP = "the tensors under 'attn.' do not fit nn.MultiheadAttention, so nothing was changed: fix or rename them"


@pytest.fixture
def stock_file(tmp_path):
    path = tmp_path / "stock.safetensors"
    save_file(prefixed(stock_attention(add_bias_kv=True), "attn."), path, metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------------- unreadable input


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.safetensors"
    assert refusal(FileNotFoundError, fold_checkpoint, missing, tmp_path / "out.safetensors") == (
        f"{missing}: no such file or directory"
    )
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        inspect_checkpoint(tmp_path / "nope.safetensors")


@pytest.mark.parametrize(
    "damage",
    [lambda data: data[:-10], lambda data: data[:5], lambda data: b"\xff" * 64, lambda data: b""],
    ids=["truncated", "cut_in_header", "garbage", "empty"],
)
def test_truncated_or_corrupt_safetensors(stock_file, tmp_path, damage):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(stock_file.read_bytes()))
    message = refusal(ValueError, fold_checkpoint, bad, tmp_path / "out.safetensors")
    assert re.fullmatch(
        re.escape(f"{bad}: not a valid safetensors file (")
        + r"Error while deserializing header: [^()]+"
        + re.escape("); it is truncated, corrupt or another format: re-download or re-save it"),
        message,
    ), message
    assert not (tmp_path / "out.safetensors").exists()


def test_a_pickle_named_safetensors_is_not_read_as_one(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save({"a": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid safetensors file (")):
        inspect_checkpoint(path)


def test_unsupported_format(tmp_path):
    path = tmp_path / "model.npz"
    path.write_bytes(b"PK")
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: unsupported input format; expected a .safetensors file, a directory with "
        "model.safetensors.index.json or pytorch_model.bin.index.json, an *.index.json file, or a "
        ".pt/.pth/.bin/.ckpt state dict"
    )


def test_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert refusal(ValueError, inspect_checkpoint, tmp_path / "empty") == (
        f"{tmp_path / 'empty'}: directory has no index (model.safetensors.index.json or "
        "pytorch_model.bin.index.json) and holds no weight file (.safetensors, .pt, .pth, .bin, .ckpt); pass the "
        "checkpoint file or its index instead"
    )


# ---------------------------------------------------------------------------------- sharded input


@pytest.fixture
def sharded(tmp_path):
    tensors = prefixed(stock_attention(), "attn.")
    keys = sorted(tensors)
    return save_sharded(tensors, tmp_path / "ckpt", [keys[:2], keys[2:]])


def _edit_index(directory, edit):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    return path


def test_shard_listed_but_missing(sharded, tmp_path):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    message = refusal(FileNotFoundError, fold_checkpoint, sharded, tmp_path / "out")
    index = sharded / "model.safetensors.index.json"
    assert message == (
        f"{index}: shard 'model-00002-of-00002.safetensors' is listed in the weight_map (for "
        f"'attn.out_proj.bias') but {sharded / 'model-00002-of-00002.safetensors'} does not exist; "
        "restore the shard or fix the index"
    )
    assert not (tmp_path / "out").exists()


def test_index_that_is_not_json(sharded, tmp_path):
    index = sharded / "model.safetensors.index.json"
    index.write_text("{not json")
    assert refusal(ValueError, fold_checkpoint, sharded, tmp_path / "out") == (
        f"{index}: not a valid index (Expecting property name enclosed in double quotes at line 1); "
        "expected JSON with a 'weight_map' of tensor name -> shard file"
    )


def test_index_without_weight_map(sharded, tmp_path):
    index = _edit_index(sharded, lambda index: index.pop("weight_map"))
    assert refusal(ValueError, fold_checkpoint, index, tmp_path / "out") == (
        f"{index}: not a valid index: 'weight_map' must map tensor names to shard file names"
    )


def test_index_listing_a_key_its_shard_lacks(sharded, tmp_path):
    _edit_index(sharded, lambda index: index["weight_map"].update({"ghost": "model-00001-of-00002.safetensors"}))
    assert refusal(ValueError, fold_checkpoint, sharded, tmp_path / "out") == (
        f"{sharded / 'model-00001-of-00002.safetensors'}: 'ghost' is listed in the index for this shard but "
        "the shard does not contain it; fix the index"
    )


def test_shard_holding_a_key_the_index_lacks(sharded, tmp_path):
    _edit_index(sharded, lambda index: index["weight_map"].pop("attn.in_proj_bias"))
    assert refusal(ValueError, fold_checkpoint, sharded, tmp_path / "out") == (
        f"{sharded / 'model-00001-of-00002.safetensors'}: 'attn.in_proj_bias' is stored here but the index "
        "maps it to None; fix the index"
    )


def test_shard_name_with_a_path_is_refused(sharded, tmp_path):
    index = _edit_index(sharded, lambda index: index["weight_map"].update({"attn.in_proj_bias": "../x.safetensors"}))
    assert refusal(ValueError, fold_checkpoint, sharded, tmp_path / "out") == (
        f"{index}: shard name '../x.safetensors' (for 'attn.in_proj_bias') is not a plain file name; "
        "shards must sit beside the index"
    )


# ---------------------------------------------------------------------------------- torch pickles


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


@reads_pickles
def test_pickle_needing_more_than_tensors_is_refused_unexecuted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"attn.in_proj_weight": torch.zeros(3, 1), "payload": _Evil()}, path)
    message = refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors")
    prefix = f"{path}: refused: the pickle needs more than tensors ("
    suffix = ") and was not executed; re-save it from trusted code as torch.save(model.state_dict(), path)"
    assert message.startswith(prefix) and message.endswith(suffix), message
    # The reason is the weights-only unpickler's own line, whose wording changes between torch versions
    # (2.13: "Trying to load unsupported GLOBAL posix.system whose module posix is blocked.").
    with pytest.raises(pickle.UnpicklingError) as refused_by_torch:
        torch.load(path, weights_only=True)
    torch_lines = [line.strip() for line in str(refused_by_torch.value).splitlines()]
    reason = message[len(prefix) : -len(suffix)]
    assert reason in torch_lines and "GLOBAL posix.system" in reason, reason
    assert not (tmp_path / "pwned-by-pickle").exists()


@pytest.mark.parametrize(
    "damage", [lambda data: data[: len(data) // 2], lambda data: b"hello world" * 10], ids=["truncated", "garbage"]
)
@reads_pickles
def test_truncated_or_corrupt_torch_file(tmp_path, damage):
    good = tmp_path / "good.pt"
    torch.save(prefixed(stock_attention(), "attn."), good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(damage(good.read_bytes()))
    message = refusal(ValueError, fold_checkpoint, bad, tmp_path / "out.safetensors")
    assert message.startswith(f"{bad}: not a readable PyTorch checkpoint (")
    assert message.endswith("); it is truncated, corrupt or another format")
    assert "\n" not in message


@reads_pickles
def test_torch_state_dict_with_a_non_tensor(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"attn.in_proj_weight": torch.zeros(3, 1), "step": 7}, path)
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: 'step' holds an int, not a tensor; safetensors stores tensors only: save model.state_dict() alone"
    )


@reads_pickles
def test_torch_file_that_is_not_a_dict(tmp_path):
    path = tmp_path / "model.pt"
    torch.save([torch.zeros(2)], path)
    assert refusal(ValueError, inspect_checkpoint, path) == (
        f"{path}: holds a list, not a state dict; expected a dict of tensors, or one under 'state_dict' or 'model'"
    )


# ---------------------------------------------------------------------------------- groups that do not fit


def _with(tmp_path, tensors):
    path = tmp_path / "odd.safetensors"
    save_file(tensors, path)
    return path


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda t: t.update({"attn.in_proj_bias": torch.zeros(23)}),
            "'attn.in_proj_bias' has shape [23], expected [24] for embed_dim=8 (from attn.out_proj.weight)",
        ),
        (
            lambda t: t.update({"attn.in_proj_weight": torch.zeros(24, 7)}),
            "'attn.in_proj_weight' has shape [24, 7], expected [24, 8] for embed_dim=8 (from attn.out_proj.weight)",
        ),
        (
            lambda t: t.update({"attn.bias_k": torch.zeros(8)}),
            "'attn.bias_k' has shape [8], expected [1, 1, 8] for embed_dim=8 (from attn.out_proj.weight)",
        ),
        (
            lambda t: t.update({"attn.out_proj.weight": torch.zeros(8, 4)}),
            "'attn.out_proj.weight' has shape [8, 4], expected [E, E]",
        ),
        (lambda t: t.pop("attn.out_proj.weight"), "'attn.in_proj_weight' has no attn.out_proj.weight beside it"),
        (lambda t: t.pop("attn.bias_v"), "'attn.bias_k' is present but attn.bias_v is missing (add_bias_kv sets both)"),
        (
            lambda t: t.pop("attn.in_proj_weight"),
            "'attn.in_proj_bias' is named like an attention parameter but has no in_proj_weight beside it",
        ),
        (
            lambda t: t.update({"attn.q_proj_bias": torch.zeros(8)}),
            "'attn.q_proj_bias' is present together with in_proj_bias (mixes the stock and slim layouts)",
        ),
        (
            lambda t: t.update({"attn.k_proj_weight": torch.zeros(8, 8)}),
            "'attn.k_proj_weight' is present together with in_proj_weight (stock has one or the other)",
        ),
        (
            lambda t: t.pop("attn.out_proj.bias"),
            "'attn.out_proj.weight' has input biases but no attn.out_proj.bias (bias=True sets both)",
        ),
        (
            lambda t: t.update({"attn.in_proj_bias": torch.zeros(24, dtype=torch.int32)}),
            "'attn.in_proj_bias' has dtype I32; attention parameters must be F16, BF16, F32 or F64",
        ),
    ],
    ids=[
        "in_proj_bias",
        "in_proj_weight",
        "bias_k",
        "out_proj",
        "no_out_proj",
        "bias_v_missing",
        "orphan_bias",
        "mixed_layout",
        "both_weights",
        "no_out_bias",
        "int_dtype",
    ],
)
def test_groups_that_do_not_fit_are_refused(tmp_path, edit, problem):
    tensors = prefixed(stock_attention(add_bias_kv=True), "attn.")
    edit(tensors)
    path = _with(tmp_path, tensors)
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == f"{path}: {problem}; {FIX_GROUP}"
    assert not (tmp_path / "out.safetensors").exists()


def test_separate_projections_missing_one(tmp_path):
    tensors = prefixed(stock_attention(kdim=5, vdim=6), "attn.")
    del tensors["attn.k_proj_weight"]
    path = _with(tmp_path, tensors)
    assert refusal(ValueError, inspect_checkpoint, path) == (
        f"{path}: 'attn.q_proj_weight' is present but attn.k_proj_weight is missing; {FIX_GROUP}"
    )


def test_a_lone_bias_k_elsewhere_is_refused_not_changed(tmp_path):
    tensors = {**prefixed(stock_attention(), "attn."), "prompt.bias_k": torch.zeros(1, 1, 8)}
    path = _with(tmp_path, tensors)
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: 'prompt.bias_k' is named like an attention parameter but has no in_proj_weight beside it; "
        "the tensors under 'prompt.' do not fit nn.MultiheadAttention, so nothing was changed: fix or rename them"
    )


def test_to_stock_refuses_biases_of_different_dtypes(tmp_path):
    tensors = key_bias_free(stock_attention(), "attn.")
    tensors["attn.v_proj_bias"] = tensors["attn.v_proj_bias"].double()
    path = _with(tmp_path, tensors)
    assert refusal(ValueError, to_stock_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: to-stock cannot convert 'attn' exactly: its input biases have dtypes F32, F64, which cannot "
        "be packed into one in_proj_bias; cast them to one dtype; nothing was written"
    )


# ---------------------------------------------------------------------------------- nothing to do


def test_non_attention_checkpoint_has_nothing_to_do(tmp_path):
    path = _with(tmp_path, {"linear.weight": torch.zeros(2, 2), "out_proj.weight": torch.zeros(2, 2)})
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: nothing to do: no attention modules found (no tensor named like in_proj_weight or "
        "q_proj_weight); nothing was written"
    )
    assert inspect_checkpoint(path).modules == ()


def test_already_converted_has_nothing_to_do(tmp_path, stock_file):
    assert refusal(ValueError, to_stock_checkpoint, stock_file, tmp_path / "out.safetensors") == (
        f"{stock_file}: nothing to do: its attention module 'attn' is already in the stock layout; nothing was written"
    )
    save_file(key_bias_free(stock_attention(), "attn."), tmp_path / "slim.safetensors")
    with pytest.raises(ValueError, match="is already in the slim layout; nothing was written"):
        strip_checkpoint(tmp_path / "slim.safetensors", tmp_path / "again.safetensors")


# ---------------------------------------------------------------------------------- the destination


def test_existing_output_needs_force(tmp_path, stock_file):
    out = tmp_path / "out.safetensors"
    precious = old_output(out)
    assert refusal(FileExistsError, fold_checkpoint, stock_file, out) == (
        f"{out}: already exists; pass force=True to replace it"  # API words
    )
    assert out.read_bytes() == precious
    fold_checkpoint(stock_file, out, force=True)
    assert load_file(out)["attn.in_proj_bias"][8:16].count_nonzero() == 0


def test_existing_output_directory_needs_force_and_only_holds_checkpoint_files(tmp_path, sharded):
    out = tmp_path / "out"
    out.mkdir()
    fold_checkpoint(sharded, out)  # an empty directory is fine
    with pytest.raises(FileExistsError, match=re.escape(f"{out}: already exists; pass force=True to replace it")):
        fold_checkpoint(sharded, out)
    for stranger in ("config.json", "stale.safetensors"):  # neither written by this output nor listed
        (out / stranger).write_bytes(b"old")
        assert refusal(ValueError, fold_checkpoint, sharded, out, force=True) == (
            f"{out}: force=True would delete '{stranger}', which this output does not write; a folder is replaced "
            "only if it holds nothing but the shards, index and companion files of a checkpoint output: move "
            "it away or choose another DST"
        )
        assert (out / stranger).read_bytes() == b"old"
        (out / stranger).unlink()
    fold_checkpoint(sharded, out, force=True)


@pytest.mark.parametrize(
    ("source_name", "destination_name", "message"),
    [
        ("file", "out.pt", "{dst}: the output is one safetensors file, so DST must end in .safetensors"),
        (
            "sharded",
            "out.safetensors",
            "{dst}: {src} is a checkpoint directory, so DST must be a directory (the shards keep their names), "
            "not a file name",
        ),
        ("file", "stock.safetensors", "{dst}: DST would overwrite the input {src}; write to another path"),
        ("sharded", "ckpt", "{dst}: DST would overwrite the input {src}; write to another path"),
        (
            "sharded",
            ".",
            "{dst}: DST holds the input {src}, and the output folder replaces DST as a whole; write "
            "to a new folder, such as {dst}/ckpt.slim",
        ),
    ],
    ids=["file_suffix", "sharded_to_file", "same_file", "same_dir", "parent_dir"],
)
def test_bad_destinations(tmp_path, stock_file, sharded, source_name, destination_name, message):
    source = stock_file if source_name == "file" else sharded
    destination = tmp_path / destination_name
    before = tree_digest(source)
    assert refusal(ValueError, fold_checkpoint, source, destination, force=True) == (
        message.format(dst=destination, src=source)
    )
    assert tree_digest(source) == before


def test_destination_folder_must_exist(tmp_path, stock_file):
    assert refusal(FileNotFoundError, fold_checkpoint, stock_file, tmp_path / "missing" / "out.safetensors") == (
        f"{tmp_path / 'missing'}: the folder for DST does not exist; create it first"
    )


def test_file_output_onto_a_directory_goes_into_it_under_the_sources_name(tmp_path, stock_file):
    """As cp does: a DST folder for a single-file SRC receives SRC's name (a torch file's as safetensors)."""
    (tmp_path / "out.safetensors").mkdir()
    report = fold_checkpoint(stock_file, tmp_path / "out.safetensors")
    assert os.listdir(tmp_path / "out.safetensors") == [stock_file.name]
    assert report.destination == tmp_path / "out.safetensors" / stock_file.name


# ---------------------------------------------------------------------------------- safety while writing


@reads_pickles
def test_input_is_never_modified(tmp_path, stock_file, sharded):
    torch.save(prefixed(stock_attention(), "attn."), tmp_path / "stock.pt")
    for source, destination in (
        (stock_file, "a.safetensors"),
        (sharded, "b"),
        (tmp_path / "stock.pt", "c.safetensors"),
    ):
        before = tree_digest(source)
        mtime = os.stat(source).st_mtime_ns
        fold_checkpoint(source, tmp_path / destination, verify=True, fold_value_bias=True)
        assert tree_digest(source) == before
        assert os.stat(source).st_mtime_ns == mtime


@pytest.mark.parametrize(
    "interrupt", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")], ids=["ctrl_c", "disk_full"]
)
def test_interrupted_write_leaves_no_partial_output(tmp_path, sharded, monkeypatch, interrupt):
    calls = []
    real_write = output_module.write_safetensors

    def write_then_fail(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise interrupt
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(output_module, "write_safetensors", write_then_fail)
    before = set(os.listdir(tmp_path))
    with pytest.raises(type(interrupt) if isinstance(interrupt, BaseException) else interrupt):
        fold_checkpoint(sharded, tmp_path / "out")
    assert set(os.listdir(tmp_path)) == before  # no output, no staging left behind
    assert calls[0].parent.name.startswith(".out.") and calls[0].parent.parent == tmp_path


def test_interrupted_forced_write_keeps_the_old_output(tmp_path, stock_file, monkeypatch):
    out = tmp_path / "out.safetensors"
    previous = old_output(out)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output_module, "write_safetensors", fail)
    with pytest.raises(KeyboardInterrupt):
        fold_checkpoint(stock_file, out, force=True)
    assert out.read_bytes() == previous
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "stock.safetensors"]


def test_dry_run_writes_nothing(tmp_path, sharded):
    report = fold_checkpoint(sharded, tmp_path / "out", dry_run=True, verify=True)
    assert report.dry_run and not report.written and report.verified
    assert not (tmp_path / "out").exists()


def test_dry_run_still_refuses_an_existing_output(tmp_path, stock_file):
    (tmp_path / "out.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        strip_checkpoint(stock_file, tmp_path / "out.safetensors", dry_run=True)


def test_copy_in_the_kernel_and_through_a_buffer_give_the_same_bytes(tmp_path, stock_file, monkeypatch):
    kernel_calls = []
    real_copy = os.copy_file_range

    def spy(*args, **kwargs):
        kernel_calls.append(args)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(os, "copy_file_range", spy)
    monkeypatch.setattr(migration_writer, "_PADDING_RATIO", 0)  # pad to the page whatever the file's size
    fold_checkpoint(stock_file, tmp_path / "kernel.safetensors")
    assert kernel_calls  # the header padding makes the copied run page-congruent

    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    fold_checkpoint(stock_file, tmp_path / "buffer.safetensors")
    assert (tmp_path / "buffer.safetensors").read_bytes() == (tmp_path / "kernel.safetensors").read_bytes()
    monkeypatch.setattr(writer_module, "_BUFFER", 7)  # many partial reads: offsets must still line up
    fold_checkpoint(stock_file, tmp_path / "tiny.safetensors")
    assert (tmp_path / "tiny.safetensors").read_bytes() == (tmp_path / "kernel.safetensors").read_bytes()


def test_written_tensors_are_aligned_to_their_element_size(tmp_path):
    tensors = {
        "a.byte": torch.zeros(3, dtype=torch.uint8),
        "b.half": torch.zeros(3, dtype=torch.float16),
        **prefixed(stock_attention(), "attn."),
        "c.double": torch.zeros(1, dtype=torch.float64),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    data = (tmp_path / "out.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    sizes = {"U8": 1, "F16": 2, "F32": 4, "F64": 8}
    for key, entry in header.items():
        if key != "__metadata__":
            assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, key
