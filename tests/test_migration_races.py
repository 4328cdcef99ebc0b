"""Files that change while a run reads them, paths that only look right, and signals at the commit.

Every input is opened once and judged by what was opened; SRC changing under the run fails it, naming
the file, and nothing is committed. The race tests flip a file many times during each run (at least
20 flips per run, counted) and check what reached DST.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import slim_mha.migration._torch_pickles as torch_pickles_module
from slim_mha.migration import fold_checkpoint, inspect_checkpoint, strip_checkpoint
from slim_mha.migration._records import TensorRecord

from _migration_checkpoints import prefixed, save_sharded, stock_attention, tree_digest
from _migration_helpers import (  # noqa: F401
    OURS,
    default_sigint,
    private_ledger,
    reads_pickles,
    refusal,
    run_cli,
)

_RUNS = 12  # migrations per race test
_FLIPS = 20  # at least this many flips during each of them


def _model(folder: Path, *, seed: int = 1, scale: float = 1.0) -> Path:
    tensors = {
        **prefixed(stock_attention(seed=seed), "enc.attn."),
        **prefixed(stock_attention(seed=seed + 1), "dec.attn."),
    }
    tensors = {key: value * scale for key, value in tensors.items()}
    keys = sorted(tensors)
    save_sharded(
        tensors, folder, [[k for k in keys if k.startswith("dec.")], [k for k in keys if k.startswith("enc.")]]
    )
    (folder / "config.json").write_text('{"model_type": "test"}')
    return folder


def _litter(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".slim-mha-" in name)


class _Flipper:
    """Swaps ``path`` between two versions (each put in place by an atomic rename) until stopped."""

    def __init__(self, path: Path, make_first, make_second) -> None:
        self.path, self.makers, self.flips = path, (make_first, make_second), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        spare = self.path.parent.parent / f"{self.path.name}.flip"  # made outside SRC, renamed into it
        while not self._stop.is_set():
            self.makers[self.flips % 2](spare)
            os.replace(spare, self.path)
            self.flips += 1
            time.sleep(0.0002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while self.flips < count and time.monotonic() < deadline:
            time.sleep(0.001)


def _racing_runs(flipper: _Flipper, run) -> list[object]:
    """``run(number)`` _RUNS times while the file flips; each run spans at least _FLIPS flips."""
    outcomes = []
    with flipper:
        for number in range(_RUNS):
            before = flipper.flips
            try:
                outcomes.append(run(number))
            except (ValueError, OSError) as error:  # the run noticed: one line, nothing written
                outcomes.append(error)
            flipper.wait_for(before + _FLIPS)
            assert flipper.flips - before >= _FLIPS
    return outcomes


# ------------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_companion_flipping_to_a_link_to_a_secret_never_copies_it(tmp_path, verify):
    model = _model(tmp_path / "model")
    secret = tmp_path / "id_rsa"
    secret.write_bytes(b"SECRET KEY\n")
    secret.chmod(0o600)

    def regular(spare: Path) -> None:
        spare.write_bytes(b"public readme\n")
        spare.chmod(0o644)

    def link(spare: Path) -> None:
        os.symlink(secret, spare)

    flipper = _Flipper(model / "README.md", regular, link)

    def run(number: int):
        out = tmp_path / f"out{number}"
        fold_checkpoint(model, out, verify=verify)
        if (out / "README.md").exists():
            assert (out / "README.md").read_bytes() == b"public readme\n"
            assert (out / "README.md").stat().st_mode & 0o777 == 0o644
        return out

    outcomes = _racing_runs(flipper, run)
    for outcome in outcomes:
        assert isinstance(outcome, Path) or str(outcome).startswith(str(model / "README.md")), repr(outcome)
    for out in tmp_path.glob("out*"):
        assert all(b"SECRET" not in path.read_bytes() for path in out.iterdir())
    assert _litter(tmp_path) == []


def test_a_link_replaced_while_it_is_resolved_is_named_in_one_line(tmp_path, monkeypatch):
    """os.path.realpath reads a link its lstat just found; a file swapped in between makes that read
    fail with EINVAL (seen in the loop above, about once in a few hundred flips): the run names the
    file and writes nothing, whichever step was resolving it."""
    model = _model(tmp_path / "model")
    (tmp_path / "readme").write_text("public readme\n")
    os.symlink(tmp_path / "readme", model / "README.md")
    real_realpath = os.path.realpath

    def flipped_under_readlink(path, *args, **kwargs):
        if os.fspath(path).endswith("README.md"):
            raise OSError(22, "Invalid argument", os.fspath(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", flipped_under_readlink)
    with pytest.raises(ValueError) as refused:
        fold_checkpoint(model, tmp_path / "out", follow_outside_links=True)
    assert str(refused.value).startswith(str(model / "README.md")), str(refused.value)
    assert "changed while this run resolved it" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists() and _litter(tmp_path) == []


def test_a_shard_flipping_to_a_link_outside_never_brings_outside_bytes(tmp_path):
    model = _model(tmp_path / "model")
    _model(tmp_path / "other", scale=3.0)  # the same layout, other values
    shard = "model-00002-of-00002.safetensors"
    original = (model / shard).read_bytes()
    outside = tmp_path / "other" / shard

    def regular(spare: Path) -> None:
        spare.write_bytes(original)

    def link(spare: Path) -> None:
        os.symlink(outside, spare)

    fold_checkpoint(model, tmp_path / "reference")
    expected = load_file(tmp_path / "reference" / shard)
    flipper = _Flipper(model / shard, regular, link)
    outcomes = _racing_runs(flipper, lambda number: fold_checkpoint(model, tmp_path / f"out{number}"))
    for number, outcome in enumerate(outcomes):
        if isinstance(outcome, Exception):
            assert str(outcome).startswith(str(model / shard)), outcome
            assert not (tmp_path / f"out{number}").exists()
        else:
            written = load_file(tmp_path / f"out{number}" / shard)
            assert all(torch.equal(written[key], expected[key]) for key in expected)
    assert _litter(tmp_path) == []


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_shard_replaced_during_the_run_fails_it_and_commits_nothing(tmp_path, monkeypatch, verify):
    """An atomic rename of a same-layout shard with new values, after the run opened the old one."""
    model = _model(tmp_path / "model")
    _model(tmp_path / "newer", scale=2.0)
    shard = model / "model-00002-of-00002.safetensors"
    real_read = TensorRecord.read

    def read_then_replace(record):
        tensor = real_read(record)
        if record.shard.path == shard and not (tmp_path / "replaced").exists():
            (tmp_path / "replaced").touch()
            os.replace(tmp_path / "newer" / shard.name, shard)
        return tensor

    monkeypatch.setattr(TensorRecord, "read", read_then_replace)
    assert refusal(ValueError, fold_checkpoint, model, tmp_path / "out", verify=verify) == (
        f"{shard}: changed while this run read it (it was replaced); nothing was written: rerun when nothing "
        "writes to SRC"
    )
    assert not (tmp_path / "out").exists() and _litter(tmp_path) == []


def test_a_shard_written_to_during_the_run_fails_it(tmp_path, monkeypatch):
    model = _model(tmp_path / "model")
    shard = model / "model-00001-of-00002.safetensors"
    real_read = TensorRecord.read

    def read_then_touch(record):
        tensor = real_read(record)
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
        return tensor

    monkeypatch.setattr(TensorRecord, "read", read_then_touch)
    message = refusal(ValueError, fold_checkpoint, model, tmp_path / "out")
    assert message.startswith(f"{shard}: changed while this run read it (it was written to)")
    assert not (tmp_path / "out").exists()


def _hub(tmp_path: Path, repository: str = "models--org--name", subfolder: str = "") -> tuple[Path, Path]:
    """A hub-cache-like tree: every file of the snapshot folder a link into the repository's blobs/."""
    repo = tmp_path / "hub" / repository
    snapshot = repo / "snapshots" / "0123abc" / subfolder if subfolder else repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    staged = _model(tmp_path / "staged")
    for number, path in enumerate(sorted(staged.iterdir())):
        blob = repo / "blobs" / f"blob{number:04d}"
        os.replace(path, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    return repo, snapshot


@pytest.mark.parametrize("subfolder", ["", "unet"], ids=["snapshot", "diffusers_subfolder"])
def test_a_real_hub_snapshot_reads_its_own_blobs_at_any_depth(tmp_path, subfolder):
    _, snapshot = _hub(tmp_path, subfolder=subfolder)
    report = fold_checkpoint(snapshot, tmp_path / "out", verify=True)
    assert report.companions == ("config.json",)


def test_a_folder_only_named_like_a_snapshot_is_not_a_hub_cache(tmp_path):
    """X/snapshots/REV/README.md -> ../../blobs/id_rsa: not models--*/, so the link leaves SRC."""
    repo, snapshot = _hub(tmp_path, repository="stolen")
    (repo / "blobs" / "id_rsa").write_bytes(b"SECRET KEY\n")
    os.symlink("../../blobs/id_rsa", snapshot / "README.md")
    message = refusal(ValueError, fold_checkpoint, snapshot, tmp_path / "out")
    assert message.startswith(f"{snapshot / 'model.safetensors.index.json'}: a symbolic link that leads outside SRC")


def test_another_repositorys_blobs_are_outside(tmp_path):
    repo, snapshot = _hub(tmp_path)
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    (other / "secret").write_bytes(b"SECRET\n")
    os.symlink(os.path.relpath(other / "secret", snapshot), snapshot / "README.md")
    report = fold_checkpoint(snapshot, tmp_path / "out")
    assert not (tmp_path / "out" / "README.md").exists()
    assert any(
        note.startswith("did not copy README.md: a symbolic link that leads outside SRC") for note in report.notes
    )


@reads_pickles
def test_a_bin_shard_linked_outside_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    state = prefixed(stock_attention(), "attn.")
    torch.save(state, tmp_path / "outside.bin")
    os.symlink(tmp_path / "outside.bin", model / "pytorch_model.bin")
    monkeypatch.setattr(torch_pickles_module.torch, "load", lambda *args, **kwargs: pytest.fail("unpickled"))
    expected = (
        f"{model / 'pytorch_model.bin'}: a symbolic link that leads outside SRC, to {tmp_path / 'outside.bin'}; its "
        "data would be copied into DST: copy the file into SRC, or pass follow_outside_links=True if you trust "
        "where it leads"
    )
    assert refusal(ValueError, fold_checkpoint, model, tmp_path / "out") == expected
    assert refusal(ValueError, inspect_checkpoint, model) == expected  # inspect shows nothing read from it


# ------------------------------------------------------------------------------------ lost or foreign data


def test_force_never_replaces_another_models_checkpoint(tmp_path):
    theirs = _model(tmp_path / "theirs", seed=7)  # a stock checkpoint: shards, index, config.json
    before = tree_digest(theirs)
    message = refusal(ValueError, fold_checkpoint, _model(tmp_path / "model"), theirs, force=True)
    assert message.startswith(f"{theirs}/model-0000")
    assert message.endswith(
        ": force=True replaces only what slim-mha-migrate wrote, and this checkpoint file carries no slim_mha "
        "metadata (someone else's checkpoint?); move it away or choose another DST"
    )
    assert tree_digest(theirs) == before and _litter(tmp_path) == []


def test_force_never_replaces_a_file_someone_else_wrote(tmp_path):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    save_file({"theirs": torch.ones(2)}, tmp_path / "theirs.safetensors")
    message = refusal(
        ValueError, fold_checkpoint, tmp_path / "in.safetensors", tmp_path / "theirs.safetensors", force=True
    )
    assert "carries no slim_mha metadata" in message
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "ours.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / "ours.safetensors", force=True)  # our own: replaced


def test_a_planted_retired_folder_is_never_restored_into_dst(tmp_path):
    model = _model(tmp_path / "model")
    planted = tmp_path / ".out.slim-mha-retired-0123abcd"
    planted.mkdir()
    (planted / "model.safetensors").write_bytes(b"planted")
    report = fold_checkpoint(model, tmp_path / "out")
    assert (planted / "model.safetensors").read_bytes() == b"planted"
    assert not (tmp_path / "out" / "model.safetensors").exists()  # DST holds this run's output only
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert f"left {planted}: it is named like slim-mha-migrate's staging, but no record" in report.notes[0]


def _bind(source: Path, target: Path) -> None:
    target.mkdir()
    result = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if result.returncode:
        pytest.skip("bind mounts need privileges this environment does not have")


def test_dst_inside_src_through_a_bind_mount_is_refused(tmp_path):
    model = _model(tmp_path / "model")
    _bind(model, tmp_path / "view")
    try:
        message = refusal(ValueError, fold_checkpoint, model, tmp_path / "view" / "slim")
        assert message == (
            f"{tmp_path / 'view' / 'slim'}: DST is inside SRC {model}, which is never modified; write outside it"
        )
        message = refusal(ValueError, fold_checkpoint, tmp_path / "view", model / "slim")
        assert "DST is inside SRC" in message
        assert not (model / "slim").exists()
    finally:
        subprocess.run(["umount", str(tmp_path / "view")], check=True)


def test_src_inside_dst_through_a_bind_mount_is_refused(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    model = _model(outer / "model")
    _bind(outer, tmp_path / "view")
    try:
        assert "DST holds the input" in refusal(ValueError, fold_checkpoint, model, tmp_path / "view", force=True)
    finally:
        subprocess.run(["umount", str(tmp_path / "view")], check=True)


# ------------------------------------------------------------------------------------ signals at the commit


PAUSED = Path(__file__).resolve().parent / "_paused_migration.py"  # the CLI held still at one point


def _environment(tmp_path: Path, **extra) -> dict[str, str]:
    tests = str(Path(__file__).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]), **extra}


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_inside_the_commit_acts_after_it_and_the_message_matches_the_disk(tmp_path, number):
    """The run pauses inside the commit, holding the signal the test sends; once let go, the commit
    completes, then the signal acts: DST is the new output, the message says so, nothing is left."""
    model = _model(tmp_path / "model")
    out = tmp_path / "out"
    fold_checkpoint(model, out)
    (out / "model-00001-of-00002.safetensors").unlink()  # so that old and new differ
    ready = tmp_path / "ready"
    process = subprocess.Popen(
        [sys.executable, str(PAUSED), "inside-commit", str(ready), "strip", str(model), str(out), "--force", "--quiet"],
        env=_environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(number)
    time.sleep(0.2)
    ready.unlink()  # let the commit finish
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + number
    assert err == f"python -m slim_mha.migration strip: interrupted after {out} was written completely\n"
    assert (out / "model-00001-of-00002.safetensors").exists()  # the new output, whole
    assert _litter(tmp_path) == []


# ------------------------------------------------------------------------------------ messages


def test_a_nul_byte_in_a_shard_name_is_named(tmp_path):
    model = _model(tmp_path / "model")
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model\u0000.safetensors"
    index_path.write_text(json.dumps(index))
    assert refusal(ValueError, fold_checkpoint, model, tmp_path / "out") == (
        f"{index_path}: shard name 'model\\x00.safetensors' (for '{key}') holds a NUL byte, which no file name "
        "can; fix the index"
    )


def test_a_non_utf8_destination_is_written(tmp_path, capsys):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/out\xff.safetensors"))
    code, _, err = run_cli(["fold", tmp_path / "in.safetensors", out], capsys)
    assert (code, err) == (0, "")
    assert "attn.in_proj_bias" in _read_keys(out)
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/dir\xff"))
    code, _, err = run_cli(["fold", _model(tmp_path / "model"), folder], capsys)
    assert (code, err) == (0, "")
    code, _, err = run_cli(["fold", tmp_path / "model", folder, "--force"], capsys)
    assert (code, err) == (0, "")


def _read_keys(path: Path) -> set[str]:
    """safetensors takes UTF-8 paths only: read the header through a descriptor instead."""
    with open(path, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    return set(header) - {"__metadata__"}


def test_a_long_destination_name_gets_a_staging_path(tmp_path):
    name = "d" * 242  # legal (NAME_MAX is 255); our suffix would not fit beside it
    fold_checkpoint(_model(tmp_path / "model"), tmp_path / name)
    assert (tmp_path / name / "model.safetensors.index.json").exists()
    fold_checkpoint(tmp_path / "model", tmp_path / name, force=True)
    assert _litter(tmp_path) == []
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    fold_checkpoint(tmp_path / "in.safetensors", tmp_path / ("f" * 240 + ".safetensors"))


@reads_pickles
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fnuz"), reason="this torch has no float8_e4m3fnuz")
def test_float8_e4m3fnuz_is_converted_alike_from_pt_and_safetensors(tmp_path):
    tensors = {**prefixed(stock_attention(), "attn."), "scale": torch.ones(4).to(torch.float8_e4m3fnuz)}
    torch.save(tensors, tmp_path / "in.pt")
    save_file(tensors, tmp_path / "in.safetensors")
    strip_checkpoint(tmp_path / "in.pt", tmp_path / "from_pt.safetensors")
    strip_checkpoint(tmp_path / "in.safetensors", tmp_path / "from_safetensors.safetensors")
    for name in ("from_pt", "from_safetensors"):
        written = load_file(tmp_path / f"{name}.safetensors")
        assert written["scale"].dtype == torch.float8_e4m3fnuz
        assert torch.equal(written["scale"].view(torch.uint8), tensors["scale"].view(torch.uint8))
