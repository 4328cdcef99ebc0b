"""Hostile and careless inputs: a model folder that links to secrets, private permissions, bombs,
a DST inside SRC, a DST holding the user's own files, and a writer fault that only --verify can see."""

from __future__ import annotations

import ast
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import slim_mha.migration._migrate as migrate_module
import slim_mha.migration._output as output_module
import slim_mha.migration._torch_pickles as torch_pickles_module
from slim_mha.migration import (
    fold_checkpoint,
    format_report,
    inspect_checkpoint,
    strip_checkpoint,
    to_stock_checkpoint,
)
from slim_mha.migration._destination import _resolved

from _migration_checkpoints import prefixed, save_sharded, stock_attention, tree_digest
from _migration_helpers import private_ledger, reads_pickles, refusal, run_cli  # noqa: F401 (private_ledger: autouse)

ROOT = Path(__file__).resolve().parents[1]
PROG = "slim-mha-migrate"


def _folder(path: Path, *, seed: int = 1) -> Path:
    """A two-shard checkpoint folder with a config.json."""
    tensors = {
        **prefixed(stock_attention(seed=seed), "enc.attn."),
        **prefixed(stock_attention(seed=seed + 1), "dec.attn."),
    }
    save_sharded(tensors, path, [[key for key in tensors if key.startswith(p)] for p in ("dec.", "enc.")])
    (path / "config.json").write_text('{"model_type": "test"}\n')
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _modes(folder: Path) -> dict[str, int]:
    return {".": _mode(folder), **{name: _mode(folder / name) for name in os.listdir(folder)}}


def _litter(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if "slim-mha-" in name)


# ------------------------------------------------------------------------ nothing from outside SRC


@pytest.mark.parametrize("name", ["README.md", "tokenizer.txt"])
def test_a_companion_linking_outside_src_is_not_copied(tmp_path, capsys, name):
    """README.md -> ~/.ssh/id_key: the secret is named in a note, never copied, whatever its mode."""
    model = _folder(tmp_path / "model")
    secret = tmp_path / "home" / "id_key"
    secret.parent.mkdir()
    secret.write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    secret.chmod(0o600)
    os.symlink(secret, model / name)
    code, out, err = run_cli(["fold", model, tmp_path / "out"], capsys)
    assert (code, err) == (0, "")
    assert not (tmp_path / "out" / name).exists()
    assert "copied 1 companion file unchanged: config.json" in out.splitlines()
    assert out.splitlines()[-1] == (
        f"note: did not copy {name}: a symbolic link that leads outside SRC, to {secret} "
        "(--follow-outside-links copies it)"
    )


def test_a_sparse_file_outside_src_does_not_become_real_disk(tmp_path):
    model = _folder(tmp_path / "model")
    sparse = tmp_path / "elsewhere.bin.txt"
    with open(sparse, "wb") as file:
        file.truncate(2**30)  # a GiB that takes no disk
    os.symlink(sparse, model / "vocab.txt")
    report = fold_checkpoint(model, tmp_path / "out")
    assert report.companions == ("config.json",) and not (tmp_path / "out" / "vocab.txt").exists()


def test_follow_outside_links_opts_in(tmp_path):
    model = _folder(tmp_path / "model")
    outside = tmp_path / "shared_vocab.txt"
    outside.write_bytes(b"a b c\n")
    os.symlink(outside, model / "vocab.txt")
    report = fold_checkpoint(model, tmp_path / "out", follow_outside_links=True)
    assert report.companions == ("config.json", "vocab.txt")
    assert (tmp_path / "out" / "vocab.txt").read_bytes() == b"a b c\n"


def test_a_shard_linking_outside_src_is_refused(tmp_path):
    model = _folder(tmp_path / "model")
    shard = model / "model-00002-of-00002.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    os.symlink(elsewhere, shard)
    assert refusal(ValueError, fold_checkpoint, model, tmp_path / "out") == (
        f"{shard}: a symbolic link that leads outside SRC, to {elsewhere}; its data would be copied into DST: "
        "copy the file into SRC, or pass follow_outside_links=True if you trust where it leads"
    )
    assert not (tmp_path / "out").exists()
    fold_checkpoint(model, tmp_path / "out", follow_outside_links=True)
    assert "enc.attn.in_proj_bias" in load_file(tmp_path / "out" / shard.name)


def test_links_inside_src_are_followed(tmp_path):
    model = _folder(tmp_path / "model")
    (model / "extra").mkdir()
    (model / "extra" / "tokenizer.json").write_bytes(b"{}")
    os.symlink("extra/tokenizer.json", model / "tokenizer.json")
    report = fold_checkpoint(model, tmp_path / "out")
    assert report.companions == ("config.json", "tokenizer.json")


# ------------------------------------------------------------------------ permissions


@pytest.fixture
def umask():
    """Run the test under the umask it sets, then put the previous one back."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def test_a_private_checkpoint_stays_private(tmp_path, umask):
    model = _folder(tmp_path / "model")
    for name in os.listdir(model):
        (model / name).chmod(0o600)
    model.chmod(0o700)
    fold_checkpoint(model, tmp_path / "out")
    assert _modes(tmp_path / "out") == {".": 0o700, **{name: 0o600 for name in os.listdir(tmp_path / "out")}}


def test_modes_are_the_sources_whatever_the_umask(tmp_path, umask):
    model = _folder(tmp_path / "model")
    model.chmod(0o750)
    (model / "config.json").chmod(0o640)
    umask(0)
    fold_checkpoint(model, tmp_path / "out")
    assert _modes(tmp_path / "out") == _modes(model)  # 0o750, config.json 0o640, the shards and index as written


def test_a_single_file_keeps_its_mode(tmp_path, umask):
    source = tmp_path / "stock.safetensors"
    save_file(prefixed(stock_attention(), "attn."), source)
    source.chmod(0o600)
    umask(0)
    fold_checkpoint(source, tmp_path / "slim.safetensors")
    assert _mode(tmp_path / "slim.safetensors") == 0o600


def test_force_keeps_dst_mode_but_never_widens_it(tmp_path, umask):
    model = _folder(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out)
    out.chmod(0o700)
    fold_checkpoint(model, out, force=True)
    assert _mode(out) == 0o700
    out.chmod(0o777)
    model.chmod(0o750)
    fold_checkpoint(model, out, force=True)
    assert _mode(out) == 0o750  # DST's own bits, less those the source lacks


def test_nothing_is_readable_by_others_while_it_is_written(tmp_path, umask, monkeypatch):
    model = _folder(tmp_path / "model")
    for name in os.listdir(model):
        (model / name).chmod(0o600)
    model.chmod(0o700)
    umask(0)
    seen = {}

    def look(point):
        if point == "after-first-shard":
            (staging,) = [tmp_path / name for name in _litter(tmp_path)]
            seen.update(_modes(staging))

    monkeypatch.setattr(output_module, "pause_for_tests", look)
    fold_checkpoint(model, tmp_path / "out")
    assert seen and all(mode & 0o077 == 0 for mode in seen.values()), seen


# ------------------------------------------------------------------------ --force: only our own files


def test_force_does_not_trust_dst_index(tmp_path):
    """DST's index lists the user's notes.safetensors, a text file: it is named, and nothing is touched."""
    model = _folder(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "notes.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "notes.safetensors").write_text("my notes, not tensors\n")
    before = tree_digest(out)
    assert refusal(ValueError, fold_checkpoint, model, out, force=True) == (
        f"{out}: force=True would delete 'notes.safetensors', which does not read as a safetensors file; a folder "
        "is replaced only if it holds nothing but the shards, index and companion files of a checkpoint output: "
        "move it away or choose another DST"
    )
    assert tree_digest(out) == before


def test_force_does_not_overwrite_a_users_own_companion(tmp_path):
    model = _folder(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out, companions=False)
    (out / "config.json").write_text('{"model_type": "mine"}\n')  # the user's, never written by a run
    before = tree_digest(out)
    message = refusal(ValueError, fold_checkpoint, model, out, force=True)
    assert message.startswith(
        f"{out}: force=True would delete 'config.json', which no earlier run wrote, or which was changed since;"
    )
    assert tree_digest(out) == before


def test_force_replaces_a_companion_it_wrote_but_not_one_edited_since(tmp_path):
    model = _folder(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out)
    (model / "config.json").write_text('{"model_type": "v2"}\n')
    fold_checkpoint(model, out, force=True)  # ours and unchanged: replaced
    assert (out / "config.json").read_text() == '{"model_type": "v2"}\n'
    (out / "config.json").write_text('{"model_type": "edited in DST"}\n')
    (model / "config.json").write_text('{"model_type": "v3"}\n')
    with pytest.raises(
        ValueError, match="would delete 'config.json', which no earlier run wrote, or which was changed"
    ):
        fold_checkpoint(model, out, force=True)
    assert (out / "config.json").read_text() == '{"model_type": "edited in DST"}\n'


def test_force_over_a_file_that_is_not_safetensors_is_refused(tmp_path):
    source = tmp_path / "stock.safetensors"
    save_file(prefixed(stock_attention(), "attn."), source)
    out = tmp_path / "out.safetensors"
    out.write_text("not a checkpoint\n")
    assert refusal(ValueError, fold_checkpoint, source, out, force=True) == (
        f"{out}: force=True replaces a file only if it reads as a safetensors file, and this one does not: move it "
        "away or choose another DST"
    )
    assert out.read_text() == "not a checkpoint\n"


# ------------------------------------------------------------------------ DST inside SRC, SRC inside DST


@pytest.mark.parametrize("spelling", ["model/slim", "model/./slim", "model/../model/slim", "link/slim", "."])
def test_dst_inside_src_is_refused_whatever_the_spelling(tmp_path, monkeypatch, spelling):
    model = _folder(tmp_path / "model")
    os.symlink(model, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    source = "model"
    if spelling == ".":
        (model / "slim").mkdir()
        monkeypatch.chdir(model / "slim")
        source = str(model)
    before = tree_digest(model)
    message = refusal(ValueError, fold_checkpoint, source, spelling)
    assert message.endswith(f"DST is inside SRC {source}, which is never modified; write outside it")
    assert tree_digest(model) == before and not _litter(model)


@pytest.mark.parametrize("spelling", ["out", "out/.", "outlink"])
def test_src_inside_dst_is_refused_whatever_the_spelling(tmp_path, monkeypatch, spelling):
    out = tmp_path / "out"
    out.mkdir()
    _folder(out / "model")
    os.symlink(out, tmp_path / "outlink")
    monkeypatch.chdir(tmp_path)
    assert ": DST holds the input out/model, and the output folder replaces DST as a whole; write to a new folder" in (
        refusal(ValueError, fold_checkpoint, "out/model", spelling, force=True)
    )


def test_dot_as_dst_with_force_replaces_it_and_names_no_staging_path(tmp_path, monkeypatch):
    model = _folder(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out)
    monkeypatch.chdir(out)
    report = fold_checkpoint(model, ".", force=True)
    assert report.destination == out
    assert "slim-mha" not in format_report(report) and _litter(tmp_path) == []


def test_dot_as_an_empty_dst(tmp_path, monkeypatch):
    model = _folder(tmp_path / "model")
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path / "out")
    fold_checkpoint(model, ".")
    assert "config.json" in os.listdir(tmp_path / "out") and _litter(tmp_path) == []


# ------------------------------------------------------------------------ bombs


@reads_pickles
def test_an_expanded_tensor_is_refused_before_anything_is_written(tmp_path):
    source = tmp_path / "bomb.pt"
    torch.save({**prefixed(stock_attention(), "attn."), "filler": torch.zeros(1).expand(2**28)}, source)
    assert source.stat().st_size < 64 * 1024
    assert refusal(ValueError, fold_checkpoint, source, tmp_path / "out.safetensors") == (
        f"{source}: 'filler' would take 1.00 GiB once written but stores 4 B (an expanded view of a smaller "
        "tensor); pass allow_expand=True if that is intended"
    )
    assert os.listdir(tmp_path) == ["bomb.pt"]


@reads_pickles
def test_views_repeating_one_storage_are_refused(tmp_path):
    source = tmp_path / "views.pt"
    block = torch.zeros(2**20)  # 4 MiB, stored once
    torch.save({**prefixed(stock_attention(), "attn."), **{f"view.{n}": block[:] for n in range(16)}}, source)
    message = refusal(ValueError, fold_checkpoint, source, tmp_path / "out.safetensors")
    assert message.startswith(f"{source}: its tensors would take 64.00 MiB once written but the file is ")
    assert message.endswith("(views that repeat the same data); pass allow_expand=True if that is intended")


@reads_pickles
def test_allow_expand_writes_an_expanded_tensor(tmp_path):
    source = tmp_path / "expanded.pt"
    torch.save({**prefixed(stock_attention(), "attn."), "filler": torch.ones(1).expand(2**23)}, source)  # 32 MiB
    with pytest.raises(ValueError, match="allow_expand"):
        fold_checkpoint(source, tmp_path / "out.safetensors")
    fold_checkpoint(source, tmp_path / "out.safetensors", allow_expand=True, verify=True)
    assert torch.equal(load_file(tmp_path / "out.safetensors")["filler"], torch.ones(2**23))


@reads_pickles
def test_inspect_of_an_expanded_tensor_does_not_materialise_it(tmp_path):
    source = tmp_path / "bomb.pt"
    torch.save({**prefixed(stock_attention(), "attn."), "filler": torch.zeros(1).expand(2**28)}, source)
    assert len(inspect_checkpoint(source).modules) == 1  # 1 GiB if it were made contiguous: it is not


@reads_pickles
def test_a_compressed_torch_zip_is_refused_unopened(tmp_path, monkeypatch):
    plain, source = tmp_path / "plain.pt", tmp_path / "packed.pt"
    torch.save(prefixed(stock_attention(), "attn."), plain)
    with zipfile.ZipFile(plain) as original, zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as packed:
        for entry in original.infolist():
            packed.writestr(entry.filename, original.read(entry))
    first = zipfile.ZipFile(source).infolist()[0].filename

    def never(*args, **kwargs):
        raise AssertionError("torch.load must not see a compressed archive")

    monkeypatch.setattr(torch_pickles_module.torch, "load", never)
    assert refusal(ValueError, fold_checkpoint, source, tmp_path / "out.safetensors") == (
        f"{source}: a compressed zip archive ('{first}' is compressed); torch.save never compresses, and a "
        "compressed entry can expand without bound: re-save it with torch.save"
    )


def test_an_output_larger_than_the_free_space_is_refused_first(tmp_path, monkeypatch):
    model = _folder(tmp_path / "model")
    free = type("usage", (), {"free": 1000})
    monkeypatch.setattr(migrate_module.shutil, "disk_usage", lambda path: free)
    with pytest.raises(OSError) as caught:
        fold_checkpoint(model, tmp_path / "out")
    assert str(caught.value).startswith(f"{tmp_path / 'out'}: the output needs ")
    assert str(caught.value).endswith(
        "but its file system has 1000 B free; free some space or choose another DST; nothing was written"
    )
    assert sorted(os.listdir(tmp_path)) == ["model"]


# ------------------------------------------------------------------------ --verify reads what was written


def _flip_after_writing(monkeypatch, key: str) -> None:
    """A writer fault: the shard holding ``key`` gets one byte of that tensor flipped once written."""
    real = output_module.write_safetensors

    def faulty(path, tensors, *args, **kwargs):
        size = real(path, tensors, *args, **kwargs)
        with open(path, "r+b") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
            if key in header:
                begin, end = header[key]["data_offsets"]
                file.seek(8 + length + begin + (end - begin) // 2)
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 0x10]))
        return size

    monkeypatch.setattr(output_module, "write_safetensors", faulty)


# Every tensor of the output: copied (weights, out_proj) and converted (in_proj_bias) alike.
_KEYS = sorted(
    f"{prefix}.attn.{local}"
    for prefix in ("dec", "enc")
    for local in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
)


@pytest.mark.parametrize("key", _KEYS)
def test_verify_catches_a_flipped_byte_in_any_tensor(tmp_path, monkeypatch, key):
    model = _folder(tmp_path / "model")
    fold_checkpoint(model, tmp_path / "ref")
    assert sorted(json.loads((tmp_path / "ref" / "model.safetensors.index.json").read_text())["weight_map"]) == _KEYS
    _flip_after_writing(monkeypatch, key)
    message = refusal(RuntimeError, fold_checkpoint, model, tmp_path / "out", verify=True)
    assert message.startswith(f"{tmp_path / 'out'}/model-0000")
    assert f": verify=True read the written file back and '{key}' differs from " in message
    assert message.endswith("; nothing was written")
    assert not (tmp_path / "out").exists() and _litter(tmp_path) == []


def test_without_verify_the_same_fault_goes_unseen(tmp_path, monkeypatch):
    """The control: the fault injected above is real, and only the read-back sees it."""
    model = _folder(tmp_path / "model")
    _flip_after_writing(monkeypatch, "enc.attn.in_proj_weight")
    fold_checkpoint(model, tmp_path / "out")
    reference = load_file(model / "model-00002-of-00002.safetensors")["enc.attn.in_proj_weight"]
    assert not torch.equal(
        load_file(tmp_path / "out" / "model-00002-of-00002.safetensors")["enc.attn.in_proj_weight"], reference
    )


def test_verify_reports_the_read_back_and_its_assumption(tmp_path, capsys):
    model = _folder(tmp_path / "model")
    code, out, err = run_cli(["fold", model, tmp_path / "out", "--verify"], capsys)
    assert (code, err) == (0, "")
    assert "verified 3 written files by reading them back: every tensor matches the source or its conversion" in out
    assert (
        "verify assumed 2 modules built without add_zero_attn, which a stock checkpoint cannot record: if one "
        "was built with it, rerun with --zero-attn (see inspect)"
    ) in out
    code, out, err = run_cli(["fold", model, tmp_path / "marked", "--verify", "--zero-attn", "*.attn"], capsys)
    assert code == 3 and "nothing to do: all 2 attention modules keep their key bias (add_zero_attn)" in err


# ------------------------------------------------------------------------ torch < 2.10


def test_old_torch_refuses_pickles_but_reads_safetensors(tmp_path, monkeypatch):
    pickled = tmp_path / "stock.pt"
    torch.save(prefixed(stock_attention(), "attn."), pickled)
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "stock.safetensors")
    monkeypatch.setattr(torch_pickles_module.torch, "__version__", "2.9.1+cpu")
    assert refusal(ValueError, fold_checkpoint, pickled, tmp_path / "out.safetensors") == (
        f"{pickled}: refused: reading a pickle (.pt, .bin...) needs a torch release >= 2.10.0, whose weights-only "
        "unpickler a crafted file cannot use to run code, and this is torch 2.9.1+cpu; upgrade torch, or save "
        "the weights as safetensors"
    )
    fold_checkpoint(tmp_path / "stock.safetensors", tmp_path / "out.safetensors")


@pytest.mark.parametrize(
    ("version", "safe"),
    [
        ("2.5.1", False),
        ("2.6.0", False),
        ("2.9.1+cu121", False),
        ("2.10.0.dev20251001", False),
        ("2.10.0a0+git1234", False),
        ("2.10.0rc1", False),
        ("2.6.0.dev20241112", False),
        ("2.10.0", True),
        ("2.10.0+cpu", True),
        ("2.13.0", True),
        ("3.0.0", True),
    ],
)
def test_pickles_need_a_torch_release_of_at_least_2_10(version, safe):
    """Pre-releases and dev builds of a fixed version may predate the fix: only a release counts."""
    assert torch_pickles_module.torch_reads_pickles_safely(version) is safe


# ------------------------------------------------------------------------ messages


@reads_pickles
def test_meta_tensors_are_named(tmp_path):
    source = tmp_path / "meta.pt"
    torch.save({**prefixed(stock_attention(), "attn."), "head.weight": torch.empty(2, 2, device="meta")}, source)
    assert refusal(ValueError, fold_checkpoint, source, tmp_path / "out.safetensors") == (
        f"{source}: 'head.weight' is a meta tensor, which holds no data; save the state dict of a model whose "
        "weights are loaded, not one built on the meta device"
    )


def test_a_deeply_nested_index_is_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    index = tmp_path / "src" / "model.safetensors.index.json"
    index.write_text("[" * 100000 + "]" * 100000)
    assert refusal(ValueError, fold_checkpoint, index, tmp_path / "out") == (
        f"{index}: not a valid index (its JSON is nested too deeply to read); expected a 'weight_map' of tensor "
        "name -> shard file"
    )


@pytest.mark.parametrize("key, shown", [("__metadata__", "'__metadata__'"), ("bad\ud800key", "'bad\\ud800key'")])
@reads_pickles
def test_keys_safetensors_cannot_hold_are_refused_before_writing(tmp_path, key, shown):
    source = tmp_path / "keys.pt"
    torch.save({**prefixed(stock_attention(), "attn."), key: torch.zeros(2)}, source)
    message = refusal(ValueError, fold_checkpoint, source, tmp_path / "out.safetensors")
    assert message.startswith(f"{source}: ") and shown in message
    assert os.listdir(tmp_path) == ["keys.pt"]


def test_to_stock_reports_the_size_on_disk(tmp_path):
    source = tmp_path / "stock.safetensors"
    save_file(prefixed(stock_attention(), "attn."), source)
    strip_checkpoint(source, tmp_path / "slim.safetensors")
    report = to_stock_checkpoint(tmp_path / "slim.safetensors", tmp_path / "back.safetensors")
    assert report.output_bytes == (tmp_path / "back.safetensors").stat().st_size


# ------------------------------------------------------------------------ imports run one way


def _relative_imports(path: Path, modules: set[str]) -> set[str]:
    """The migration modules ``path`` imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            found.update(name if name in modules else "__init__" for name in names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slim_mha.migration"):
            found.add(node.module.removeprefix("slim_mha.migration").lstrip(".").split(".")[0] or "__init__")
    return found & modules


def test_no_import_cycles_in_migration():
    files = {path.stem: path for path in (ROOT / "migration").glob("*.py")}
    graph = {name: _relative_imports(path, set(files)) for name, path in files.items()}

    def visit(name: str, trail: list[str]) -> None:
        for imported in graph[name]:
            assert imported not in trail, f"import cycle: {' -> '.join(trail + [imported])}"
            visit(imported, trail + [imported])

    for name in graph:
        visit(name, [name])
    assert graph["_migrate"] and graph["__init__"] == {
        "_dcp_load",
        "_migrate",
        "_state_dict",
        "report",
    }  # lazy imports seen


def test_paths_resolve_as_realpath_does(tmp_path):
    """The shortcut that resolves a folder once per run agrees with realpath on every spelling."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    os.symlink(tmp_path / "a" / "b", tmp_path / "c" / "link")
    for path in (
        tmp_path / "c" / "link" / ".." / "x",
        tmp_path / "c" / "link",
        tmp_path / "a" / "file",
        tmp_path / "c" / ".",
        Path("relative"),
    ):
        assert _resolved(path, {}) == Path(os.path.realpath(path)), path


def test_a_dcp_folder_on_a_torch_that_reads_pickles_unsafely_is_refused_unread(tmp_path, monkeypatch, capsys):
    """DCP's chunks are torch pickles: refused where other pickles are, before a chunk is read."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from slim_mha.migration import _dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: one process", as intended
        dcp.save({"model": prefixed(stock_attention(), "attn.")}, checkpoint_id=tmp_path / "ckpt")
    monkeypatch.setattr(_dcp, "torch_reads_pickles_safely", lambda: False)
    code, _, err = run_cli(["fold", tmp_path / "ckpt", tmp_path / "out"], capsys)
    assert code == 1 and "a DCP folder's chunks are torch pickles" in err and "install torch >= 2.10.0" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
