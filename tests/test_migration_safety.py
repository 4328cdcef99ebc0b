"""Data safety of the writing side: what --force may replace, inputs reached through symlinks, the
staging path and its litter, the atomic swap, and runs really killed (SIGKILL, SIGTERM) mid-write."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

import slim_mha.migration._staging as staging_module
from slim_mha.migration import fold_checkpoint

from _migration_checkpoints import prefixed, save_sharded, stock_attention, tree_digest
from _migration_helpers import (  # noqa: F401 (private_ledger: autouse)
    OURS,
    default_sigint,
    left_by_a_killed_run,
    old_output,
    private_ledger,
    refusal,
)

ROOT = Path(__file__).resolve().parents[1]
PAUSED = Path(__file__).resolve().parent / "_paused_migration.py"  # the CLI held still at one point
LITTER = re.compile(r"\.(.+)\.slim-mha-(staging|retired)-[0-9a-f]{8}")


def _tensors(modules: int = 3) -> dict:
    tensors = {}
    for number in range(modules):
        tensors.update(prefixed(stock_attention(seed=number + 1), f"layers.{number}.attn."))
    return tensors


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A three-shard checkpoint folder with a config.json beside it."""
    tensors = _tensors()
    shards = [[key for key in tensors if key.startswith(f"layers.{number}.")] for number in range(3)]
    folder = save_sharded(tensors, tmp_path / "ckpt", shards)
    (folder / "config.json").write_text('{"model_type": "test"}\n')
    return folder


def _litter(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if LITTER.fullmatch(name))


def _force_refused(source: Path, destination: Path, message: str, **options) -> None:
    before = tree_digest(destination.parent)
    assert refusal(ValueError, fold_checkpoint, source, destination, force=True, **options) == message
    assert tree_digest(destination.parent) == before  # nothing touched, anywhere beside DST either
    assert _litter(destination.parent) == []


# ---------------------------------------------------------------------------------- what --force may replace


_ENTRY_RULE = (
    "; a folder is replaced only if it holds nothing but the shards, index and companion files of a "
    "checkpoint output: move it away or choose another DST"
)


def test_force_refuses_a_subdirectory_named_like_a_shard(tmp_path, sharded):
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    backup = out / "backup.safetensors"
    backup.mkdir()
    (backup / "weights.safetensors").write_bytes(b"the user's backup")
    _force_refused(
        sharded, out, f"{out}: force=True would delete 'backup.safetensors', which is a directory" + _ENTRY_RULE
    )


@pytest.mark.parametrize(
    "entry", ["extra.safetensors", "model-00002-of-00003.safetensors"], ids=["other_name", "even_under_a_shard_name"]
)
def test_force_refuses_a_symlink_entry(tmp_path, sharded, entry):
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    (tmp_path / "elsewhere.safetensors").write_bytes(b"someone else's")
    (out / entry).unlink(missing_ok=True)  # a shard the output writes: replaced by the link
    os.symlink(tmp_path / "elsewhere.safetensors", out / entry)
    _force_refused(sharded, out, f"{out}: force=True would delete '{entry}', which is a symbolic link" + _ENTRY_RULE)
    assert (tmp_path / "elsewhere.safetensors").read_bytes() == b"someone else's"


def test_force_refuses_a_file_this_output_does_not_write(tmp_path, sharded):
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    (out / "notes.txt").write_text("mine")
    _force_refused(
        sharded, out, f"{out}: force=True would delete 'notes.txt', which this output does not write" + _ENTRY_RULE
    )


def test_force_replaces_a_previous_output_sharded_differently(tmp_path, sharded):
    """The shards that the folder's own index lists are a previous output's: they may go."""
    out = tmp_path / "out"
    tensors = _tensors()
    save_sharded(tensors, out, [list(tensors)], metadata=OURS)  # one shard, with a name this run does not write
    (out / "model-00001-of-00001.safetensors").rename(out / "old-shard.safetensors")
    index = (out / "model.safetensors.index.json").read_text().replace("model-00001-of-00001", "old-shard")
    (out / "model.safetensors.index.json").write_text(index)
    fold_checkpoint(sharded, out, force=True)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]


def test_force_refuses_a_file_destination_that_is_a_symlink(tmp_path):
    save_file(prefixed(stock_attention(), "attn."), tmp_path / "in.safetensors")
    (tmp_path / "target.safetensors").write_bytes(b"keep")
    os.symlink(tmp_path / "target.safetensors", tmp_path / "out.safetensors")
    _force_refused(
        tmp_path / "in.safetensors",
        tmp_path / "out.safetensors",
        f"{tmp_path / 'out.safetensors'}: is a symbolic link; force=True replaces only a regular file: "
        "remove the link or choose another DST",
    )


def test_a_directory_destination_that_is_a_symlink_is_refused(tmp_path, sharded):
    fold_checkpoint(sharded, tmp_path / "real_out")
    os.symlink(tmp_path / "real_out", tmp_path / "out")
    _force_refused(
        sharded,
        tmp_path / "out",
        f"{tmp_path / 'out'}: is a symbolic link; the output folder is put in "
        "place as a whole, so DST must be a real folder: give the link's target, or choose another DST",
    )


# ---------------------------------------------------------------------------------- inputs through symlinks


def test_symlinked_shards_protect_their_targets(tmp_path, sharded):
    """`fold src real --force`, where src/ holds symlinks to real/*: refused, real/ untouched; first as
    links that leave SRC, then, when they are followed, as inputs."""
    links = tmp_path / "links"
    links.mkdir()
    for name in os.listdir(sharded):
        os.symlink(sharded / name, links / name)
    index = links / "model.safetensors.index.json"  # opened first, and judged before a byte is read
    _force_refused(
        links,
        sharded,
        (
            f"{index}: a symbolic link that leads outside SRC, to {sharded / index.name}; its data would be copied "
            "into DST: copy the file into SRC, or pass follow_outside_links=True if you trust where it leads"
        ),
    )
    shard = links / "model-00001-of-00003.safetensors"
    message = (
        f"{sharded}: DST would overwrite the input {shard} (through its link, {sharded / shard.name}); "
        "write to another path"
    )
    _force_refused(links, sharded, message, follow_outside_links=True)


def test_a_symlinked_single_file_protects_its_target(tmp_path):
    real = tmp_path / "real.safetensors"
    save_file(prefixed(stock_attention(), "attn."), real)
    os.symlink(real, tmp_path / "link.safetensors")
    _force_refused(
        tmp_path / "link.safetensors",
        real,
        f"{real}: DST would overwrite the input {tmp_path / 'link.safetensors'}; write to another path",
    )


def test_a_hard_link_to_the_input_is_the_input(tmp_path):
    real = tmp_path / "real.safetensors"
    save_file(prefixed(stock_attention(), "attn."), real)
    os.link(real, tmp_path / "same.safetensors")
    _force_refused(
        real,
        tmp_path / "same.safetensors",
        f"{tmp_path / 'same.safetensors'}: DST would overwrite the input {real}; write to another path",
    )


def test_a_companion_reached_through_a_symlink_is_protected(tmp_path, sharded):
    """DST must not hold a file the run copies from, even if SRC reaches it through a symlink."""
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    (sharded / "config.json").unlink()
    os.symlink(out / "config.json", sharded / "config.json")
    _force_refused(
        sharded,
        out,
        f"{out}: DST would overwrite the input {sharded / 'config.json'} (through its "
        f"link, {out / 'config.json'}); write to another path",
        follow_outside_links=True,
    )


# ---------------------------------------------------------------------------------- staging and swapping


def test_force_swaps_a_directory_atomically_and_leaves_no_litter(tmp_path, sharded, monkeypatch):
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    first = tree_digest(out)
    calls = []
    real = staging_module._renameat2
    monkeypatch.setattr(staging_module, "_renameat2", lambda *args: calls.append(args[2]) or real(*args))
    fold_checkpoint(sharded, out, force=True)
    assert calls == [staging_module._RENAME_EXCHANGE]  # one exchange, never two renames
    assert tree_digest(out) == first  # same input, same bytes
    assert _litter(tmp_path) == []


def test_what_appears_in_dst_after_the_check_is_not_deleted(tmp_path, sharded, monkeypatch):
    """Between the last check and the swap, a folder appears in DST: the swap goes ahead, and the old
    tree is emptied of its regular files only, then left (with the newcomer) and reported."""
    reference = _reference(tmp_path, sharded)
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    real = staging_module._renameat2

    def late_arrival(source, target, flags):
        if flags == staging_module._RENAME_EXCHANGE:
            (out / "late").mkdir()
            (out / "late" / "work.txt").write_text("precious")
        return real(source, target, flags)

    monkeypatch.setattr(staging_module, "_renameat2", late_arrival)
    report = fold_checkpoint(sharded, out, force=True)
    assert _names(out) == reference
    [aside] = _litter(tmp_path)
    assert (tmp_path / aside / "late" / "work.txt").read_text() == "precious"
    assert os.listdir(tmp_path / aside) == ["late"]
    assert report.notes == (
        f"left {tmp_path / aside}, the replaced {out}: it could not be removed (Directory not empty); look "
        "inside and remove it",
    )
    monkeypatch.setattr(staging_module, "_renameat2", real)
    report = fold_checkpoint(sharded, out, force=True)  # the next run does not delete it either
    assert (tmp_path / aside / "late" / "work.txt").read_text() == "precious"
    assert report.notes == (f"left {tmp_path / aside}: named like our staging, but it holds something we never write",)


def test_fallback_without_exchange_replaces_and_rolls_back_on_failure(tmp_path, sharded, monkeypatch):
    reference = _reference(tmp_path, sharded)
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    old_output(out / "model-00003-of-00003.safetensors")  # mark the old output
    monkeypatch.setattr(staging_module, "_renameat2", lambda *args: False)  # as on a file system without it
    old = tree_digest(out)
    renames = []
    real_rename = os.rename

    def second_rename_fails(source, target):
        renames.append((Path(source).name, Path(target).name))
        if len(renames) == 2:
            raise OSError(13, "Permission denied")
        real_rename(source, target)

    monkeypatch.setattr(staging_module.os, "rename", second_rename_fails)
    with pytest.raises(
        OSError, match=re.escape(f"{out}: cannot write the output (Permission denied); {out} was left as it was")
    ):
        fold_checkpoint(sharded, out, force=True)
    assert tree_digest(out) == old and _litter(tmp_path) == []
    aside, staged = renames[0][1], renames[1][0]
    assert aside.startswith(".out.slim-mha-retired-") and staged.startswith(".out.slim-mha-staging-")
    assert renames == [("out", aside), (staged, "out"), (aside, "out")]  # moved aside, failed, moved back
    fold_checkpoint(sharded, out, force=True)  # the rename works this time
    assert renames[3][0] == "out" and renames[4][1] == "out"
    assert _names(out) == reference and _litter(tmp_path) == []


def test_next_run_restores_a_destination_moved_aside_by_a_killed_run(tmp_path, sharded):
    """The fallback's only window: killed between the two renames, DST absent, old tree aside."""
    out = tmp_path / "out"
    fold_checkpoint(sharded, out)
    old = {Path(path).name: digest for path, digest in tree_digest(out).items()}
    aside = tmp_path / ".out.slim-mha-retired-0123abcd"
    out.rename(aside)
    left_by_a_killed_run(aside)
    with pytest.raises(FileExistsError, match=re.escape(f"{out}: already exists; pass force=True to replace it")):
        fold_checkpoint(sharded, out)  # restored first, so it is protected like any existing DST
    assert {Path(path).name: digest for path, digest in tree_digest(out).items()} == old
    assert not aside.exists()


def test_litter_is_removed_only_when_no_live_run_holds_it(tmp_path, sharded):
    stale = tmp_path / ".out.slim-mha-staging-00000001"
    stale.mkdir()
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"partial")
    live = tmp_path / ".out.slim-mha-staging-00000002"
    live.mkdir()
    strange = tmp_path / ".out.slim-mha-staging-00000003"  # our name, but holds what we never write
    strange.mkdir()
    (strange / "sub").mkdir()
    for path in (stale, live, strange):
        left_by_a_killed_run(path)
    planted = tmp_path / ".out.slim-mha-staging-00000005"  # our name, but no run of ours made it
    planted.mkdir()
    (planted / "model-00001-of-00003.safetensors").write_bytes(b"someone's")
    other = tmp_path / ".other.slim-mha-staging-00000004"  # another DST's litter: not ours to judge
    other.write_bytes(b"x")
    legacy = tmp_path / ".out.c1af7afd.tmp"
    legacy.mkdir()
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        report = fold_checkpoint(sharded, tmp_path / "out")
    finally:
        os.close(holder)
    assert not stale.exists() and live.exists() and strange.exists() and other.exists() and legacy.exists()
    assert (planted / "model-00001-of-00003.safetensors").read_bytes() == b"someone's"
    assert report.notes == (  # in name order
        f"{legacy} looks left by an interrupted run of an older slim_mha; remove it by hand",
        f"removed {stale}, a partial output left by an interrupted run",
        f"left {live}: another slim-mha-migrate run is writing it",
        f"left {strange}: named like our staging, but it holds something we never write",
        f"left {planted}: it is named like slim-mha-migrate's staging, but no record of this tool's runs says it "
        "made it; look inside and remove it by hand",
    )


def test_litter_that_cannot_be_removed_is_said_and_does_not_stop_the_run(tmp_path, sharded, monkeypatch):
    stale = tmp_path / ".out.slim-mha-staging-00000001"
    stale.write_bytes(b"partial")
    left_by_a_killed_run(stale)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(staging_module, "_delete", refuse)
    report = fold_checkpoint(sharded, tmp_path / "out")
    assert report.notes == (f"could not remove {stale}, left by an interrupted run (Permission denied)",)
    assert stale.exists() and (tmp_path / "out" / "config.json").exists()


def test_an_input_that_fails_while_writing_is_named(tmp_path, sharded, monkeypatch):
    import slim_mha.migration._writer as writer_module

    real_open = os.open

    def unreadable(path, flags, *args, **kwargs):
        if Path(path).name == "config.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(writer_module.os, "open", unreadable)
    assert refusal(ValueError, fold_checkpoint, sharded, tmp_path / "out") == (
        f"{sharded / 'config.json'}: cannot be read (Permission denied)"
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_dry_run_leaves_litter_alone(tmp_path, sharded):
    stale = tmp_path / ".out.slim-mha-staging-00000001"
    stale.write_bytes(b"partial")
    fold_checkpoint(sharded, tmp_path / "out", dry_run=True)
    assert stale.exists()


def test_files_and_folders_are_fsynced_before_the_rename(tmp_path, sharded, monkeypatch):
    events = []
    real_fsync, real_rename, real_syncfs = os.fsync, staging_module._renameat2, staging_module._syncfs
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd)
    )
    monkeypatch.setattr(
        staging_module,
        "_syncfs",
        lambda fd: events.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}"))) or real_syncfs(fd),
    )
    monkeypatch.setattr(staging_module, "_renameat2", lambda *args: events.append(("rename",)) or real_rename(*args))
    fold_checkpoint(sharded, tmp_path / "out")
    rename = events.index(("rename",))
    synced = [Path(path).name for _, path in events[:rename]]
    staging_name = Path(events[rename - 1][1]).name  # the staging folder itself, last before the rename
    assert staging_name.startswith(".out.slim-mha-staging-")
    assert events[0] == ("syncfs", events[rename - 1][1])  # the companions (config.json), all in one call
    assert sorted(synced[1:-1]) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert events[rename + 1 :] == [("fsync", str(tmp_path))]  # and the folder holding DST, after


# ---------------------------------------------------------------------------------- real kills


def _start(source: Path, destination: Path, pause: str, ready: Path, *options: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, str(PAUSED), pause, str(ready), "fold", str(source), str(destination), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        preexec_fn=default_sigint,
    )


def _wait_for(ready: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180  # importing torch on a busy machine
    while not ready.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before the pause: {process.communicate()}")
        assert time.monotonic() < deadline, "the run never reached the pause"
        time.sleep(0.05)


def _reference(tmp_path: Path, sharded: Path) -> dict[str, str]:
    fold_checkpoint(sharded, tmp_path / "reference")
    return {Path(path).name: digest for path, digest in tree_digest(tmp_path / "reference").items()}


def _names(folder: Path) -> dict[str, str]:
    return {Path(path).name: digest for path, digest in tree_digest(folder).items()}


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.parametrize("existing", [False, True], ids=["new_dst", "force_over_old_dst"])
def test_killed_mid_write(tmp_path, sharded, kill, existing):
    """Killed after the first of three shards: SRC intact, DST the old tree or absent, no lie told,
    and the next run removes the litter and writes DST whole."""
    reference = _reference(tmp_path, sharded)
    source_before = tree_digest(sharded)
    out = tmp_path / "out"
    if existing:
        tensors = _tensors()
        save_sharded(tensors, out, [list(tensors)[:9], list(tensors)[9:]], metadata=OURS)  # an older output
    old = tree_digest(out) if existing else None
    ready = tmp_path / "ready"
    process = _start(sharded, out, "after-first-shard", ready, "--force")
    _wait_for(ready, process)
    process.send_signal(kill)
    stdout, stderr = process.communicate(timeout=120)
    assert tree_digest(sharded) == source_before
    assert (tree_digest(out) if existing else out.exists()) == (old if existing else False)
    if kill == signal.SIGTERM:  # cleaned up like Ctrl-C, and says what exists
        assert process.returncode == 128 + signal.SIGTERM and stdout == ""
        state = f": {out} was left as it was" if existing else ""
        assert stderr == f"slim-mha-migrate fold: interrupted; nothing was written{state}\n".replace(
            "slim-mha-migrate", "python -m slim_mha.migration"
        )
        assert _litter(tmp_path) == []
    else:
        assert process.returncode == -signal.SIGKILL
        assert len(_litter(tmp_path)) == 1  # the partial staging folder, which the next run removes
    litter = _litter(tmp_path)
    report = fold_checkpoint(sharded, out, force=True)
    assert report.notes == tuple(
        f"removed {tmp_path / name}, a partial output left by an interrupted run" for name in litter
    )
    assert _names(out) == reference and _litter(tmp_path) == []


@pytest.mark.slow  # a subprocess; the same state as a kill mid-write, one step later
def test_killed_just_before_the_swap_keeps_the_old_output(tmp_path, sharded):
    reference = _reference(tmp_path, sharded)
    out = tmp_path / "out"
    tensors = _tensors()
    save_sharded(tensors, out, [list(tensors)])
    old = tree_digest(out)
    ready = tmp_path / "ready"
    process = _start(sharded, out, "before-commit", ready, "--force")
    _wait_for(ready, process)
    process.kill()
    process.communicate(timeout=120)
    assert tree_digest(out) == old and len(_litter(tmp_path)) == 1
    fold_checkpoint(sharded, out, force=True)
    assert _names(out) == reference and _litter(tmp_path) == []


@pytest.mark.parametrize(
    "interrupt",
    # Ctrl-C there is also checked in-process (test_migration_cli.py); a real one is the slow variant.
    [pytest.param(signal.SIGINT, id="sigint", marks=pytest.mark.slow), pytest.param(signal.SIGTERM, id="sigterm")],
)
def test_interrupted_just_after_the_swap_says_the_output_was_written(tmp_path, sharded, interrupt):
    reference = _reference(tmp_path, sharded)
    out = tmp_path / "out"
    ready = tmp_path / "ready"
    process = _start(sharded, out, "after-commit", ready)
    _wait_for(ready, process)
    process.send_signal(interrupt)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + interrupt
    assert stderr == f"python -m slim_mha.migration fold: interrupted after {out} was written completely\n"
    assert "nothing was written" not in stderr
    assert _names(out) == reference and _litter(tmp_path) == []
