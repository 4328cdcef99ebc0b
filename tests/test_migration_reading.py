"""The reading side of the migration (issue 11): linear cost, provenance read back, every input format,
special files, and messages that show file-supplied names escaped."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import signal
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import slim_mha
import slim_mha.migration._checkpoint as checkpoint_module
import slim_mha.migration._plan as plan_module
from slim_mha import SlimMultiheadAttention
from slim_mha.bias import FORMAT_VERSION
from slim_mha.migration import (
    fold_checkpoint,
    inspect_checkpoint,
    strip_checkpoint,
    to_stock_checkpoint,
)
from slim_mha.migration._records import TensorRecord

from _migration_checkpoints import (
    attention_inputs,
    key_bias_free,
    load_sharded,
    prefixed,
    randomize,
    save_sharded,
    stock_attention,
    tree_digest,
)
from _migration_helpers import private_ledger, reads_pickles, refusal, run_cli  # noqa: F401 (private_ledger: autouse)

pytestmark = pytest.mark.filterwarnings(
    "ignore:enable_nested_tensor is True", "ignore:The PyTorch API of nested tensors"
)


def slim_outputs(state: dict, **config) -> torch.Tensor:
    module = SlimMultiheadAttention(8, 2, **config)
    module.load_state_dict(state, strict=True)
    with torch.no_grad():
        return module.eval()(*attention_inputs(8), need_weights=False)[0]


def stock_outputs(module: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return module.eval()(*attention_inputs(8), need_weights=False)[0]


# ---------------------------------------------------------------------------------- linear cost


def _many_modules(directory, modules: int, *, key_bias_free_layout: bool = False):
    tensors = {}
    for number in range(modules):
        module, prefix = stock_attention(add_bias_kv=number % 2 == 1, seed=number), f"layers.{number}.attn."
        tensors.update(key_bias_free(module, prefix) if key_bias_free_layout else prefixed(module, prefix))
        tensors[f"layers.{number}.norm.weight"] = torch.randn(8)
    keys = list(tensors)
    return save_sharded(tensors, directory, [keys[: len(keys) // 2], keys[len(keys) // 2 :]])


def _count_reading(monkeypatch) -> tuple[Counter, Counter]:
    """Count header parses (ours and safetensors') per file, and data reads per tensor."""
    headers, reads = Counter(), Counter()
    real_header, real_open, real_read = checkpoint_module._read_header, checkpoint_module.safe_open, TensorRecord.read

    def counted_header(opened):
        headers[("parse", opened.path.name)] += 1
        return real_header(opened)

    def counted_open(path, *args, **kwargs):  # given the opened file's /proc/self/fd path
        headers[("safe_open", os.path.basename(os.path.realpath(path)))] += 1
        return real_open(path, *args, **kwargs)

    def counted_read(record):
        reads[record.key] += 1
        return real_read(record)

    monkeypatch.setattr(checkpoint_module, "_read_header", counted_header)
    monkeypatch.setattr(checkpoint_module, "safe_open", counted_open)
    monkeypatch.setattr(TensorRecord, "read", counted_read)
    return headers, reads


@pytest.mark.parametrize("operation", ["fold_verify", "inspect", "to_stock_verify"])
def test_each_header_is_parsed_once_and_each_tensor_read_once(tmp_path, monkeypatch, operation):
    """A quadratic run re-parsed the whole header for every tensor read and read each module twice:
    the counts here would grow with the number of modules."""
    counts = []
    for modules in (2, 12):
        source = _many_modules(
            tmp_path / f"stock{modules}", modules, key_bias_free_layout=operation == "to_stock_verify"
        )
        headers, reads = _count_reading(monkeypatch)
        if operation == "inspect":
            inspect_checkpoint(source)
        elif operation == "fold_verify":
            fold_checkpoint(source, tmp_path / f"out{modules}", verify=True)
        else:
            to_stock_checkpoint(source, tmp_path / f"out{modules}", verify=True)
        monkeypatch.undo()
        shards = sorted(path.name for path in source.glob("*.safetensors"))
        assert headers == Counter({(kind, name): 1 for name in shards for kind in ("parse", "safe_open")})
        assert reads and max(reads.values()) == 1, reads.most_common(3)
        assert not any(key.endswith("norm.weight") for key in reads)  # other tensors are copied, never read
        counts.append(sum(headers.values()))
    assert counts[0] == counts[1]


def test_a_tensor_read_returns_the_stored_bytes(tmp_path):
    tensors = {
        "a": torch.randn(3, 4, dtype=torch.float64),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.zeros(0, 3),
        "d": torch.arange(7, dtype=torch.int16),
        "e": torch.tensor([True, False, True]),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    records = checkpoint_module.open_checkpoint(tmp_path / "t.safetensors").records
    for key, expected in tensors.items():
        actual = records[key].read()
        assert actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected)


def test_a_file_that_shrank_after_opening_is_reported(tmp_path):
    tensors = prefixed(stock_attention(), "attn.")
    path = tmp_path / "stock.safetensors"
    save_file(tensors, path)
    records = checkpoint_module.open_checkpoint(path).records
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    last = max(records.values(), key=lambda record: record.offset)
    assert refusal(ValueError, last.read) == (
        f"{path}: cannot read '{last.key}' (the file ends 4 bytes early; it changed while being read)"
    )


# ---------------------------------------------------------------------------------- provenance


@pytest.fixture
def zero_attn_stock(tmp_path):
    stock = stock_attention(add_zero_attn=True, seed=3)
    path = tmp_path / "stock.safetensors"
    save_file(
        {**prefixed(stock, "attn."), **prefixed(stock_attention(seed=6), "plain."), "other.weight": torch.randn(4)},
        path,
    )
    return stock, path


def test_zero_attn_mark_survives_a_round_trip_api(tmp_path, zero_attn_stock):
    """fold --zero-attn records the mark; every later run (fold, strip, inspect) reads it back."""
    stock, source = zero_attn_stock
    fold_checkpoint(source, tmp_path / "folded.safetensors", zero_attn=["attn"], verify=True)
    with safe_open(tmp_path / "folded.safetensors", "pt") as handle:
        assert handle.metadata()["slim_mha.zero_attn_modules"] == "attn"
    report = inspect_checkpoint(tmp_path / "folded.safetensors")
    assert [(module.name, module.zero_attn) for module in report.modules] == [("attn", True), ("plain", False)]
    assert report.modules[0].fold == (
        "nothing to fold (add_zero_attn: the zero key makes the key bias matter; stock's layout kept)"
    )
    # Folding the folded file again has nothing to do, and says why: the mark was read back.
    with pytest.raises(
        ValueError,
        match=r"nothing to do: of its 2 attention modules, 1 has its key slot at zero already and 1 keeps its key bias \(add_zero_attn\)",
    ):
        fold_checkpoint(tmp_path / "folded.safetensors", tmp_path / "again.safetensors", verify=True)
    assert not (tmp_path / "again.safetensors").exists()
    assert torch.equal(load_file(tmp_path / "folded.safetensors")["attn.in_proj_bias"], stock.in_proj_bias.detach())
    with pytest.raises(ValueError, match="strip cannot convert 'attn' exactly: it is marked add_zero_attn"):
        strip_checkpoint(tmp_path / "folded.safetensors", tmp_path / "stripped.safetensors")


def test_zero_attn_mark_survives_a_round_trip_cli(tmp_path, zero_attn_stock, capsys):
    stock, source = zero_attn_stock
    folded, again = tmp_path / "folded.safetensors", tmp_path / "again.safetensors"
    assert run_cli(["fold", source, folded, "--zero-attn", "attn", "--verify"], capsys)[0] == 0
    code, out, err = run_cli(["fold", folded, again, "--verify"], capsys)
    assert (
        code == 3
        and re.search(
            r"nothing to do: of its 2 attention modules, 1 has its key slot at zero already and 1 keeps its key bias \(add_zero_attn\)",
            err,
        )
        and not again.exists()
    )  # the same status as strip's
    code, out, _ = run_cli(["inspect", folded], capsys)
    assert any(line.startswith("attn: ") and line.endswith("add_zero_attn yes") for line in out.splitlines())
    assert torch.equal(load_file(folded)["attn.in_proj_bias"], stock.in_proj_bias.detach())


def test_sharded_round_trip_reads_the_mark_from_the_index_and_shards(tmp_path):
    stock = stock_attention(add_zero_attn=True, seed=4)
    tensors = {**prefixed(stock, "dec.attn."), **prefixed(stock_attention(seed=5), "enc.attn.")}
    keys = sorted(tensors)
    source = save_sharded(tensors, tmp_path / "stock", [keys[: len(keys) // 2], keys[len(keys) // 2 :]])
    fold_checkpoint(source, tmp_path / "folded", zero_attn=["dec.*"])
    index = json.loads((tmp_path / "folded" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["slim_mha.zero_attn_modules"] == "dec.attn"
    with pytest.raises(
        ValueError,
        match=r"nothing to do: of its 2 attention modules, 1 has its key slot at zero already and 1 keeps its key bias \(add_zero_attn\)",
    ):
        fold_checkpoint(tmp_path / "folded", tmp_path / "again", verify=True)
    report = inspect_checkpoint(tmp_path / "folded")
    assert [(module.name, module.zero_attn) for module in report.modules] == [("dec.attn", True), ("enc.attn", False)]
    out = load_sharded(tmp_path / "folded")
    assert torch.equal(out["dec.attn.in_proj_bias"], stock.in_proj_bias.detach())


def test_verify_fails_when_a_recorded_key_bias_would_be_dropped(tmp_path, zero_attn_stock, monkeypatch):
    """The checker can fail: a fold that zeroes the key slot of a recorded add_zero_attn module is caught."""
    _, source = zero_attn_stock
    fold_checkpoint(source, tmp_path / "folded.safetensors", zero_attn=["attn"])
    real_fold = plan_module.zero_key_bias

    def losing_fold(in_proj_bias, bias_k=None, *, add_zero_attn=False):
        return real_fold(in_proj_bias, bias_k)  # the mark is ignored: b_k is zeroed where it matters

    monkeypatch.setattr(plan_module, "zero_key_bias", losing_fold)
    monkeypatch.setattr(plan_module, "keeps_key_bias", lambda *, add_zero_attn: False)
    with pytest.raises(RuntimeError, match="verify=True failed for 'attn'"):
        fold_checkpoint(tmp_path / "folded.safetensors", tmp_path / "again.safetensors", verify=True)
    assert not (tmp_path / "again.safetensors").exists()


def test_a_folded_value_bias_is_noted_on_every_later_run(tmp_path):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "stock.safetensors")
    strip_checkpoint(tmp_path / "stock.safetensors", tmp_path / "eval.safetensors", fold_value_bias=True)
    back = to_stock_checkpoint(tmp_path / "eval.safetensors", tmp_path / "back.safetensors")
    note = (
        "an earlier run folded the value bias into out_proj.bias (slim_mha.value_bias_folded): these weights "
        "compute the original model's outputs in eval mode only"
    )
    assert note in back.notes and note in inspect_checkpoint(tmp_path / "back.safetensors").notes
    assert note not in inspect_checkpoint(tmp_path / "stock.safetensors").notes


def _with_metadata(tmp_path, metadata: dict[str, str]):
    path = tmp_path / "marked.safetensors"
    save_file(prefixed(stock_attention(), "attn."), path, metadata=metadata)
    return path


def test_a_recorded_mark_naming_no_module_is_refused(tmp_path):
    path = _with_metadata(tmp_path, {"slim_mha.zero_attn_modules": "attn,decoder.attn"})
    assert refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors") == (
        f"{path}: its metadata marks 'decoder.attn' as an add_zero_attn module (slim_mha.zero_attn_modules), but "
        "no attention module has that name: the tensors were renamed after slim_mha wrote them; convert the "
        "original checkpoint, with zero_attn"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_a_newer_or_edited_format_version_is_refused(tmp_path):
    path = _with_metadata(tmp_path, {"slim_mha.format_version": "99"})
    assert refusal(ValueError, inspect_checkpoint, path) == (
        f"{path}: written by a newer slim_mha (format version 99; this one reads up to "
        f"{FORMAT_VERSION}); upgrade slim_mha to convert it"
    )
    path = _with_metadata(tmp_path, {"slim_mha.format_version": "one"})
    with pytest.raises(ValueError, match="metadata slim_mha.format_version is 'one', not a number"):
        fold_checkpoint(path, tmp_path / "out.safetensors")


# ---------------------------------------------------------------------------------- formats


def _transformer() -> nn.Transformer:
    return nn.Transformer(
        d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0
    )


def _transformer_outputs(model: nn.Transformer) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    source, target = torch.randn(6, 2, 16, generator=generator), torch.randn(5, 2, 16, generator=generator)  # (S, B, E)
    with torch.no_grad():
        return model.eval()(source, target, tgt_mask=nn.Transformer.generate_square_subsequent_mask(5))


def _assert_slim_model_matches(stock: nn.Transformer, tensors: dict) -> None:
    with slim_mha.patched():
        slim = _transformer()
    slim.load_state_dict(tensors, strict=True)
    torch.testing.assert_close(_transformer_outputs(slim), _transformer_outputs(stock), rtol=1e-5, atol=1e-5)


def _save_bin_shards(state: dict, directory, shards: int = 2):
    """A Hugging Face-style sharded torch checkpoint: pytorch_model-0000N-of-0000M.bin and its index."""
    directory.mkdir()
    keys = list(state)
    weight_map = {}
    for number in range(shards):
        name = f"pytorch_model-{number + 1:05d}-of-{shards:05d}.bin"
        part = keys[number * len(keys) // shards : (number + 1) * len(keys) // shards]
        torch.save({key: state[key] for key in part}, directory / name)
        weight_map.update({key: name for key in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return directory


@pytest.mark.parametrize("through", ["directory", "index_file"])
@reads_pickles
def test_sharded_bin_checkpoint(tmp_path, through):
    stock = randomize(_transformer(), seed=0)
    state = {key: value.detach().clone() for key, value in stock.state_dict().items()}
    source = _save_bin_shards(state, tmp_path / "stock")
    before = tree_digest(source)
    argument = source if through == "directory" else source / "pytorch_model.bin.index.json"
    report = fold_checkpoint(argument, tmp_path / "slim", verify=True)
    assert tree_digest(source) == before
    assert report.shards == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    written = sorted(
        path.name for path in (tmp_path / "slim").iterdir() if path.name.endswith((".json", ".safetensors"))
    )
    assert written == [*report.shards, "model.safetensors.index.json"]
    _assert_slim_model_matches(stock, load_sharded(tmp_path / "slim"))


@reads_pickles
def test_directory_with_a_single_pytorch_model_bin(tmp_path):
    stock = randomize(_transformer(), seed=1)
    (tmp_path / "stock").mkdir()
    torch.save(stock.state_dict(), tmp_path / "stock" / "pytorch_model.bin")
    report = fold_checkpoint(tmp_path / "stock", tmp_path / "slim", verify=True)
    assert report.shards == ("model.safetensors",)
    _assert_slim_model_matches(stock, load_file(tmp_path / "slim" / "model.safetensors"))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


@reads_pickles
def test_a_malicious_bin_shard_is_refused_unexecuted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = prefixed(stock_attention(), "attn.")
    source = _save_bin_shards(state, tmp_path / "stock")
    shard = source / "pytorch_model-00002-of-00002.bin"
    torch.save({key: value for key, value in torch.load(shard, weights_only=True).items()} | {"x": _Evil()}, shard)
    with pytest.raises(ValueError, match=r"^" + str(shard) + r": refused: the pickle needs more than tensors \("):
        fold_checkpoint(source, tmp_path / "slim")
    assert not (tmp_path / "pwned-by-pickle").exists()


@reads_pickles
def test_lightning_checkpoint_is_read_like_a_pt(tmp_path):
    """A PyTorch Lightning .ckpt as Lightning writes it: the model's state dict under 'state_dict'
    (keys prefixed by the LightningModule's attribute), beside optimizer and loop state."""
    stock = randomize(_transformer(), seed=2)
    optimizer = torch.optim.Adam(stock.parameters(), lr=1e-3)
    stock.train()
    _transformer_outputs(stock).sum()  # no grad: build a real optimizer state with one step below
    with torch.enable_grad():
        generator = torch.Generator().manual_seed(3)
        loss = stock(torch.randn(6, 2, 16, generator=generator), torch.randn(5, 2, 16, generator=generator)).sum()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    stock.eval()
    checkpoint = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{key}": value.detach().clone() for key, value in stock.state_dict().items()},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {
                "best_model_score": torch.tensor(0.25),
                "best_model_path": "epoch=2.ckpt",
            }
        },
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-3, "d_model": 16},
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    report = fold_checkpoint(tmp_path / "last.ckpt", tmp_path / "slim.safetensors", verify=True)
    assert report.notes == (
        "read the state dict under 'state_dict'; ignored: callbacks, epoch, global_step, hparams_name, "
        "hyper_parameters, loops, lr_schedulers, optimizer_states, pytorch-lightning_version",
    )
    assert len(report.changed) == 3
    out = load_file(tmp_path / "slim.safetensors")
    _assert_slim_model_matches(stock, {key.removeprefix("model."): value for key, value in out.items()})


# ---------------------------------------------------------------------------------- special files


@pytest.fixture
def no_hang():
    """Fail instead of hanging: opening a named pipe blocks until a writer appears."""

    def expire(signum, frame):
        raise TimeoutError("the run blocked on a special file")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["model.pt", "model.ckpt", "model.safetensors"])
def test_a_named_pipe_as_source_is_refused_without_opening(tmp_path, no_hang, name, capsys):
    pipe = tmp_path / name
    os.mkfifo(pipe)
    message = f"{pipe}: is a named pipe (FIFO), not a regular file; pass the checkpoint file itself"
    assert refusal(ValueError, fold_checkpoint, pipe, tmp_path / "out.safetensors") == message
    with pytest.raises(ValueError, match="is a named pipe"):
        inspect_checkpoint(pipe)
    assert run_cli(["inspect", pipe], capsys) == (1, "", f"slim-mha-migrate inspect: error: {message}\n")


def test_a_named_pipe_inside_a_directory_is_refused(tmp_path, no_hang):
    (tmp_path / "ckpt").mkdir()
    os.mkfifo(tmp_path / "ckpt" / "model.safetensors")
    assert refusal(ValueError, inspect_checkpoint, tmp_path / "ckpt") == (
        f"{tmp_path / 'ckpt' / 'model.safetensors'}: is a named pipe (FIFO), not a regular file; replace it with "
        "the checkpoint file"
    )
    (tmp_path / "sharded").mkdir()
    os.mkfifo(tmp_path / "sharded" / "model.safetensors.index.json")
    with pytest.raises(ValueError, match="model.safetensors.index.json: is a named pipe .FIFO., not a regular file"):
        inspect_checkpoint(tmp_path / "sharded")


@pytest.fixture
def two_shards(tmp_path):
    tensors = prefixed(stock_attention(), "attn.")
    keys = sorted(tensors)
    return save_sharded(tensors, tmp_path / "ckpt", [keys[:2], keys[2:]])


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (os.mkfifo, "is a named pipe (FIFO), not a regular file"),
        (os.mkdir, "is a directory, not a file"),
        (lambda path: os.symlink(path.parent / "gone.safetensors", path), "is a dangling symbolic link"),
    ],
    ids=["fifo", "directory", "dangling_symlink"],
)
def test_a_shard_that_is_not_a_file_is_named_truthfully(tmp_path, two_shards, no_hang, make, problem):
    shard = two_shards / "model-00002-of-00002.safetensors"
    shard.unlink()
    make(shard)
    assert refusal(ValueError, fold_checkpoint, two_shards, tmp_path / "out") == (
        f"{two_shards / 'model.safetensors.index.json'}: shard 'model-00002-of-00002.safetensors' is listed in the "
        f"weight_map (for 'attn.out_proj.bias') but {shard} {problem}; put the shard file there or fix the index"
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------- not a torch file


@reads_pickles
def test_random_bytes_in_a_pt_are_not_called_a_malicious_pickle(tmp_path):
    generator = random.Random(0)
    for number in range(8):
        data = bytes(generator.getrandbits(8) for _ in range(4096))
        path = tmp_path / f"random{number}.pt"
        path.write_bytes(data)
        with pytest.raises(ValueError) as caught:
            fold_checkpoint(path, tmp_path / "out.safetensors")
        message = str(caught.value)
        assert message.startswith(f"{path}: not a readable PyTorch checkpoint ("), message
        assert message.endswith("); it is truncated, corrupt or another format") and "refused" not in message
    # The same bytes behind a pickle header still reach torch's weights-only unpickler, which rejects them.
    path = tmp_path / "pickle_header.pt"
    path.write_bytes(b"\x80\x02" + data)
    with pytest.raises(ValueError) as caught:
        fold_checkpoint(path, tmp_path / "out.safetensors")
    message = str(caught.value)
    # torch words the unpickler's line differently across versions ("WeightsUnpickler error: " before it on 2.4).
    assert message.startswith(f"{path}: not a readable PyTorch checkpoint (") and "refused" not in message, message
    assert "Unsupported operand " in message and message.endswith("); it is truncated, corrupt or another format")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert refusal(ValueError, inspect_checkpoint, tmp_path / "empty.pt") == (
        f"{tmp_path / 'empty.pt'}: not a readable PyTorch checkpoint (it is empty); it is truncated, corrupt or "
        "another format"
    )


@pytest.mark.parametrize("how", ["legacy_torch_save", "plain_pickle"])
@reads_pickles
def test_malicious_pickles_in_other_layouts_are_still_refused(tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    payload = {"attn.in_proj_weight": torch.zeros(3, 1), "payload": _Evil()}
    if how == "legacy_torch_save":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(_Evil(), protocol=2))
    message = refusal(ValueError, fold_checkpoint, path, tmp_path / "out.safetensors")
    assert message.startswith(f"{path}: refused: the pickle needs more than tensors (")
    assert "GLOBAL posix.system" in message
    assert not (tmp_path / "pwned-by-pickle").exists()


# ---------------------------------------------------------------------------------- messages


def test_names_with_control_characters_are_shown_escaped(tmp_path, capsys):
    hostile = "enc\x1b[2K\r\n.attn"
    path = tmp_path / "names.safetensors"
    save_file({**prefixed(stock_attention(), hostile + "."), f"{hostile}.extra\tkey": torch.zeros(1)}, path)
    code, out, err = run_cli(["inspect", path], capsys)
    assert (code, err) == (0, "")
    assert not any(char in out.replace("\n", "") for char in "\x1b\r\t")
    assert out.splitlines()[1].startswith("enc\\x1b[2K\\r\\n.attn: stock, embed_dim=8")
    code, out, err = run_cli(["fold", path, tmp_path / "slim.safetensors"], capsys)
    assert code == 0 and "  enc\\x1b[2K\\r\\n.attn: zero the key slot of in_proj_bias" in out.splitlines()
    assert hostile + ".in_proj_bias" in load_file(tmp_path / "slim.safetensors")  # the data keeps the real name

    odd = tmp_path / "odd.safetensors"
    save_file({**prefixed(stock_attention(), "attn."), "x\x1b[2K.bias_k": torch.zeros(1, 1, 8)}, odd)
    expected = (
        f"{odd}: 'x\\x1b[2K.bias_k' is named like an attention parameter but has no in_proj_weight beside it; the "
        "tensors under 'x\\x1b[2K.' do not fit nn.MultiheadAttention, so nothing was changed: fix or rename them"
    )
    assert refusal(ValueError, fold_checkpoint, odd, tmp_path / "out.safetensors") == expected
    assert run_cli(["fold", odd, tmp_path / "out.safetensors"], capsys) == (
        1,
        "",
        f"slim-mha-migrate fold: error: {expected}\n",
    )


def test_a_shard_name_with_an_escape_is_shown_escaped(tmp_path, two_shards):
    index = two_shards / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["attn.in_proj_bias"] = "\x1b[2Kmissing.safetensors"
    index.write_text(json.dumps(content))
    message = refusal(FileNotFoundError, fold_checkpoint, two_shards, tmp_path / "out")
    assert "\x1b" not in message and "shard '\\x1b[2Kmissing.safetensors'" in message


def test_inspect_and_fold_agree_on_a_checkpoint_without_biases(tmp_path, capsys):
    path = tmp_path / "nobias.safetensors"
    save_file(prefixed(stock_attention(bias=False), "attn."), path)
    module = inspect_checkpoint(path).modules[0]
    assert (module.layout, module.key_bias) == ("no input bias", "absent")
    assert module.strip == module.fold == module.to_stock == "nothing to do (no input bias)"
    for operation in (fold_checkpoint, strip_checkpoint, to_stock_checkpoint):
        with pytest.raises(ValueError) as caught:
            operation(path, tmp_path / "out.safetensors")
        assert str(caught.value) == (
            f"{path}: nothing to do: its attention module 'attn' has no input biases (bias=False); nothing was written"
        )
    mixed = tmp_path / "mixed.safetensors"
    save_file(
        {
            **prefixed(stock_attention(bias=False), "a."),
            **prefixed(stock_attention(bias=False), "b."),
            **prefixed(stock_attention(), "c."),
        },
        mixed,
    )
    strip_checkpoint(mixed, tmp_path / "slim.safetensors")
    assert refusal(ValueError, strip_checkpoint, tmp_path / "slim.safetensors", tmp_path / "again.safetensors") == (
        f"{tmp_path / 'slim.safetensors'}: nothing to do: of its 3 attention modules, 1 is already in the slim "
        "layout and 2 have no input biases (bias=False); nothing was written"
    )
    with pytest.raises(ValueError, match="none of its 2 attention modules has input biases"):
        save_file({**prefixed(stock_attention(bias=False), "a."), **prefixed(stock_attention(bias=False), "b.")}, path)
        fold_checkpoint(path, tmp_path / "out.safetensors")


def test_a_folder_with_both_layouts_is_read_through_its_safetensors(tmp_path):
    """Hugging Face repositories often hold both; transformers, too, prefers the safetensors files."""
    stock = stock_attention(seed=6)
    source = save_sharded(prefixed(stock, "attn."), tmp_path / "repo", [sorted(prefixed(stock, "attn."))])
    torch.save(
        {key: torch.zeros_like(value) for key, value in prefixed(stock, "attn.").items()}, source / "pytorch_model.bin"
    )
    (source / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {}}))
    report = inspect_checkpoint(source)
    assert report.shards == ("model-00001-of-00001.safetensors",)
    assert report.modules[0].key_bias == "non-zero"


def test_errors_name_the_path_the_user_gave(tmp_path, two_shards, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (two_shards / "model-00002-of-00002.safetensors").unlink()
    message = refusal(FileNotFoundError, fold_checkpoint, "ckpt", "out")
    assert message.startswith(
        "ckpt/model.safetensors.index.json: shard 'model-00002-of-00002.safetensors' is listed in the weight_map"
    )
    assert "but ckpt/model-00002-of-00002.safetensors does not exist" in message
    code, out, err = run_cli(["fold", "ckpt", "out"], capsys)
    assert code == 1 and err.startswith("slim-mha-migrate fold: error: ckpt/model.safetensors.index.json: shard")
