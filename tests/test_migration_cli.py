"""The CLI through its real entry point: argv in, captured stdout/stderr and the exit code out."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import slim_mha.migration as migration_package
import slim_mha.migration._checkpoint as checkpoint_module
import slim_mha.migration._migrate as migrate_module
import slim_mha.migration._output as output_module
import slim_mha.migration._torch_pickles as torch_pickles_module
from slim_mha.migration.cli import build_parser
from slim_mha.migration.report import format_size

from _migration_checkpoints import prefixed, save_sharded, stock_attention, tree_digest
from _migration_helpers import default_sigint, old_output, private_ledger, run_cli  # noqa: F401 (private_ledger: autouse)

PROG = "slim-mha-migrate"


@pytest.fixture
def stock_file(tmp_path):
    path = tmp_path / "stock.safetensors"
    tensors = {
        **prefixed(stock_attention(seed=1), "enc.attn."),
        **prefixed(stock_attention(add_bias_kv=True), "dec.attn."),
    }
    save_file(tensors, path)
    return path


@pytest.fixture
def sharded(tmp_path):
    tensors = {**prefixed(stock_attention(seed=1), "a."), **prefixed(stock_attention(seed=2), "b.")}
    return save_sharded(
        tensors,
        tmp_path / "ckpt",
        [[k for k in tensors if k.startswith("a.")], [k for k in tensors if k.startswith("b.")]],
    )


# ------------------------------------------------------------------------------------ success


def test_fold_prints_what_it_did(tmp_path, stock_file, capsys):
    out_path = tmp_path / "slim.safetensors"
    code, out, err = run_cli(["fold", stock_file, out_path], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"fold {stock_file} -> {out_path}: 2 of 2 attention modules changed",
        "  dec.attn: zero the key slot of in_proj_bias, fold it into bias_k",
        "  enc.attn: zero the key slot of in_proj_bias",
        f"wrote {out_path} (1 shard, 10 tensors, {format_size(out_path.stat().st_size)})",  # its size on disk
    ]
    assert load_file(out_path)["dec.attn.in_proj_bias"][8:16].count_nonzero() == 0


def test_verify_and_dry_run(tmp_path, stock_file, capsys):
    code, out, err = run_cli(["fold", stock_file, tmp_path / "slim.safetensors", "--verify", "--dry-run"], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].startswith("  dec.attn: zero the key slot of in_proj_bias, fold it into bias_k [verified, error ")
    assert lines[3].startswith("verified 2 modules: largest relative output error ")
    assert lines[4] == (
        "verify assumed 2 modules built without add_zero_attn, which a stock checkpoint cannot record: if one "
        "was built with it, rerun with --zero-attn (see inspect)"
    )
    assert not (tmp_path / "slim.safetensors").exists()
    run_cli(["fold", stock_file, tmp_path / "slim.safetensors"], capsys)  # the size planned is the size written
    size = format_size((tmp_path / "slim.safetensors").stat().st_size)
    assert (
        lines[5]
        == f"dry run: would write {tmp_path / 'slim.safetensors'} (1 shard, 10 tensors, {size}); nothing was written"
    )


def test_quiet_prints_nothing_and_still_writes(tmp_path, stock_file, capsys):
    code, out, err = run_cli(["fold", stock_file, tmp_path / "slim.safetensors", "--quiet"], capsys)
    assert (code, out, err) == (0, "", "")
    assert (tmp_path / "slim.safetensors").exists()


def test_zero_attn_fold_value_bias_and_to_stock(tmp_path, capsys):
    tensors = {
        **prefixed(stock_attention(add_zero_attn=True), "dec.layers.0.attn."),
        **prefixed(stock_attention(seed=3), "enc.attn."),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    code, out, err = run_cli(
        ["fold", tmp_path / "in.safetensors", tmp_path / "folded.safetensors", "--zero-attn", "dec.layers.*.attn"],
        capsys,
    )
    assert (code, err) == (0, "")
    assert (
        "  dec.layers.0.attn: nothing to fold (add_zero_attn: the zero key makes the key bias matter; stock's layout kept)"
        in out
    )
    assert "  enc.attn: zero the key slot of in_proj_bias" in out
    code, out, err = run_cli(
        [
            "fold",
            tmp_path / "in.safetensors",
            tmp_path / "eval.safetensors",
            "--zero-attn",
            "dec.layers.*.attn",
            "--fold-value-bias",
        ],
        capsys,
    )
    assert code == 1
    assert err.startswith(
        f"{PROG} fold: error: {tmp_path / 'in.safetensors'}: fold cannot convert "
        "'dec.layers.0.attn' exactly: it is marked add_zero_attn, and the zero value token"
    )
    code, out, err = run_cli(
        ["strip", tmp_path / "in.safetensors", tmp_path / "slim.safetensors", "--zero-attn", "dec.layers.*.attn"],
        capsys,
    )
    assert code == 1 and "use fold, which keeps stock's layout for it" in err
    code, out, err = run_cli(["to-stock", tmp_path / "folded.safetensors", tmp_path / "back.safetensors"], capsys)
    assert code == 3 and "all 2 attention modules are already in the stock layout" in err  # nothing to do


def test_inspect_output(tmp_path, stock_file, capsys):
    code, out, err = run_cli(["inspect", stock_file], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    size = format_size(stock_file.stat().st_size)  # on disk
    assert lines[0] == f"{stock_file}: 2 attention modules; 1 shard, 10 tensors, {size}"
    assert lines[1].startswith("dec.attn: stock, embed_dim=8, float32, key bias non-zero (max |b_k| ")
    assert lines[1].endswith("), bias_k/bias_v yes, add_zero_attn: unknown (not recorded in stock checkpoints)")
    assert lines[2:6] == [
        "  shapes:   in_proj_weight [24, 8], in_proj_bias [24], bias_k [1, 1, 8], bias_v [1, 1, 8], "
        "out_proj.weight [8, 8], out_proj.bias [8]",
        "  strip:    refuses: bias_k is present (use fold)",
        "  fold:     zero the key slot of in_proj_bias, fold it into bias_k",
        "  to-stock: nothing to do (already stock)",
    ]


# ------------------------------------------------------------------------------------ failures


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["fold", "{tmp}/missing.safetensors", "{tmp}/out.safetensors"],
            "{tmp}/missing.safetensors: no such file or directory",
        ),
        (
            ["strip", "{tmp}/stock.safetensors", "{tmp}/out.safetensors"],
            "{tmp}/stock.safetensors: strip cannot convert 'dec.attn' exactly: bias_k is present ('dec.attn.bias_k' "
            "in {tmp}/stock.safetensors), so dropping the key bias is not exact; use fold, which folds it into "
            "bias_k (or pass --keep-inexact to strip the rest and leave such modules as they are); nothing was written",
        ),
        (
            ["fold", "{tmp}/stock.safetensors", "{tmp}/stock.safetensors", "--force"],
            "{tmp}/stock.safetensors: DST would overwrite the input {tmp}/stock.safetensors; write to another path",
        ),
        (
            ["inspect", "{tmp}/stock.safetensors", "--zero-attn", "nope"],
            "{tmp}/stock.safetensors: --zero-attn 'nope' matches no attention module; modules are named like "
            "'dec.attn' (see inspect)",
        ),
    ],
    ids=["missing", "strip_refuses", "same_path", "zero_attn_typo"],
)
def test_errors_are_one_line_with_exit_code_1(tmp_path, stock_file, capsys, argv, message):
    command = argv[0]
    code, out, err = run_cli([arg.format(tmp=tmp_path) for arg in argv], capsys)
    assert code == 1
    assert out == ""
    assert err == f"{PROG} {command}: error: {message.format(tmp=tmp_path)}\n"


def test_nothing_to_do_exits_with_its_own_status_not_a_failures(tmp_path, stock_file, capsys):
    """A pipeline that re-runs its migration tells "already done" (3) from a failure (1)."""
    code, out, err = run_cli(["to-stock", stock_file, tmp_path / "out.safetensors"], capsys)
    assert (code, out) == (3, "")
    assert err == (
        f"{PROG} to-stock: {stock_file}: nothing to do: all 2 attention modules are already in the stock layout; "
        "nothing was written\n"
    )
    assert not (tmp_path / "out.safetensors").exists()
    code, _, _ = run_cli(["fold", stock_file, tmp_path / "once.safetensors"], capsys)
    assert code == 0
    code, _, err = run_cli(["fold", tmp_path / "once.safetensors", tmp_path / "twice.safetensors"], capsys)
    assert code == 3 and "nothing to do" in err and "error" not in err
    assert "exit status" in build_parser().format_help().lower() and "3 nothing to do" in build_parser().format_help()


def test_existing_output_then_force(tmp_path, stock_file, capsys):
    old_output(tmp_path / "out.safetensors")
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)
    assert (code, err) == (
        1,
        f"{PROG} fold: error: {tmp_path / 'out.safetensors'}: already exists; pass --force to replace it\n",
    )
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors", "--force"], capsys)
    assert (code, err) == (0, "")


def test_truncated_file_error_is_one_line(tmp_path, stock_file, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(stock_file.read_bytes()[:-3])
    code, out, err = run_cli(["inspect", bad], capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"{PROG} inspect: error: {bad}: not a valid safetensors file (")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_bug_is_still_one_line(tmp_path, stock_file, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("unexpected\nthing")

    monkeypatch.setattr(migrate_module, "find_attention_modules", broken)
    code, out, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)
    assert (code, out) == (1, "")
    assert err == f"{PROG} fold: internal error: TypeError: unexpected thing; nothing was written\n"


def test_ctrl_c_exits_130(tmp_path, stock_file, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output_module, "write_safetensors", interrupted)
    code, out, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)
    assert (code, err) == (130, f"{PROG} fold: interrupted; nothing was written\n")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "the following arguments are required: {strip,fold,to-stock,inspect}"),
        (["fold", "a.safetensors"], "the following arguments are required: DST"),
        (
            ["to-stock", "a.safetensors", "b.safetensors", "--fold-value-bias"],
            "unrecognized arguments: --fold-value-bias",
        ),
        (["inspect", "a.safetensors", "--force"], "unrecognized arguments: --force"),
    ],
    ids=["no_command", "no_dst", "to_stock_value_bias", "inspect_force"],
)
def test_usage_errors_exit_2(capsys, argv, fragment):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].endswith(fragment)


# ------------------------------------------------------------------------------------ help


@pytest.mark.parametrize("command", ["strip", "fold", "to-stock", "inspect"])
def test_every_subcommand_help_shows_real_examples(command, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    assert code == 0
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert examples and all(line.startswith(f"  {PROG} {command} ") for line in examples)


def test_fold_value_bias_help_says_eval_only(capsys):
    _, out, _ = run_cli(["fold", "--help"], capsys)
    assert "exact for inference (eval) only" in " ".join(out.split())


def test_top_level_help_lists_the_subcommands(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for command in ("strip", "fold", "to-stock", "inspect"):
        assert f"    {command} " in out


# ------------------------------------------------------------------------------------ progress bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_for_sharded_input(tmp_path, sharded, capsys, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, _, _ = run_cli(["fold", sharded, tmp_path / "out"], capsys)
    assert code == 0
    assert "100%" in terminal.getvalue()


def test_no_progress_bar_with_quiet_or_without_a_terminal(tmp_path, sharded, capsys, monkeypatch):
    code, _, err = run_cli(["fold", sharded, tmp_path / "plain"], capsys)  # captured stderr is not a TTY
    assert (code, err) == (0, "")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, _, _ = run_cli(["fold", sharded, tmp_path / "quiet", "--quiet"], capsys)
    assert code == 0 and terminal.getvalue() == ""


def test_no_progress_bar_for_a_small_single_file_even_on_a_terminal(tmp_path, stock_file, capsys, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)[0] == 0
    assert terminal.getvalue() == ""


# ------------------------------------------------------------------------------------ help


def _readable_names() -> list[str]:
    """Every input the reader accepts, from the reader's own constants."""
    return [
        ".safetensors",
        *checkpoint_module.TORCH_SUFFIXES,
        "*.index.json",
        checkpoint_module.INDEX_NAME,
        checkpoint_module.TORCH_INDEX_NAME,
        checkpoint_module.SINGLE_NAME,
        checkpoint_module.TORCH_SINGLE_NAME,
        *torch_pickles_module._WRAPPERS,
        "weights_only=True",
    ]


@pytest.mark.parametrize("where", ["help", "docstring"])
def test_the_help_and_the_docstring_name_every_accepted_format_and_no_other(where, capsys):
    if where == "help":
        code, text, err = run_cli(["--help"], capsys)
        assert (code, err) == (0, "")
    else:
        text = migration_package.__doc__.replace("``", "")
    text = " ".join(text.split())
    missing = [name for name in _readable_names() if name not in text]
    assert missing == [], f"the {where} does not name {missing}"
    # and every file suffix it names is one the reader takes (or .json, of an index)
    suffixes = set(re.findall(r"(?<![\w*])\.(?:safetensors|json|[a-z]{2,4})\b", text))
    assert suffixes <= {".safetensors", ".json", *checkpoint_module.TORCH_SUFFIXES}, suffixes


@pytest.mark.parametrize("command", ["strip", "fold", "to-stock", "inspect"])
def test_each_subcommands_help_names_the_input_files(command, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    assert code == 0
    source_help = " ".join(out.split()).split("SRC checkpoint to read: ")[1]
    for suffix in [".safetensors", *checkpoint_module.TORCH_SUFFIXES, "*.index.json", "checkpoint folder"]:
        assert suffix in source_help


# ------------------------------------------------------------------------------------ real processes


def _environment() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def test_python_dash_m_migration(tmp_path, stock_file):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "slim_mha.migration",
            "fold",
            str(stock_file),
            str(tmp_path / "slim.safetensors"),
            "--verify",
        ],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines()[0] == (
        f"fold {stock_file} -> {tmp_path / 'slim.safetensors'}: 2 of 2 attention modules changed"
    )
    assert load_file(tmp_path / "slim.safetensors")["dec.attn.in_proj_bias"][8:16].count_nonzero() == 0


def test_console_script_error_has_no_traceback(tmp_path):
    script = shutil.which("slim-mha-migrate", path=os.path.dirname(sys.executable))
    command = [script] if script else [sys.executable, "-m", "slim_mha.migration"]
    result = subprocess.run(
        [*command, "inspect", str(tmp_path / "missing.pt")],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=120,
    )
    prog = PROG if script else "python -m slim_mha.migration"
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == f"{prog} inspect: error: {tmp_path / 'missing.pt'}: no such file or directory\n"


# Test-only hooks, run as sitecustomize.py from a folder put first on PYTHONPATH (they ship nowhere): each
# touches READY at the point under test and waits there; the test then sends SIGINT and touches SENT.
_HOLD_IMPORT = """\
import pathlib, sys, time

class _HoldImport:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            pathlib.Path({ready!r}).touch()
            time.sleep(300)  # the SIGINT interrupts this sleep, inside the import statement
        return None

sys.meta_path.insert(0, _HoldImport())
"""

_HOLD_SHUTDOWN = """\
import atexit, pathlib, time

def _hold():  # registered first, so it runs last: the run is over and Python is shutting down
    pathlib.Path({ready!r}).touch()
    deadline = time.monotonic() + 120
    while not pathlib.Path({sent!r}).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # where a handler still set would raise KeyboardInterrupt

atexit.register(_hold)
"""


def _interrupted_at(hook: str, command: list[str], cwd: Path, **fields: str) -> subprocess.CompletedProcess:
    ready, sent = cwd.parent / "ready", cwd.parent / "sent"
    folder = cwd.parent / "hook"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(hook.format(ready=str(ready), sent=str(sent), **fields))
    environment = _environment()
    environment["PYTHONPATH"] = os.pathsep.join([str(folder), environment["PYTHONPATH"]])
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        preexec_fn=default_sigint,
    )
    try:
        deadline = time.monotonic() + 180  # a busy machine
        while not ready.exists():
            assert process.poll() is None, f"the run ended before the point under test: {process.communicate()}"
            assert time.monotonic() < deadline, "the run never reached the point under test"
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        sent.touch()
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize(
    "module",
    [
        "torch",
        "safetensors",
        "slim_mha.migration._migrate",
    ],
)
def test_ctrl_c_during_an_import_is_one_line(tmp_path, module):
    work = tmp_path / "work"
    work.mkdir()
    save_file(prefixed(stock_attention(), "attn."), work / "stock.safetensors")
    before = tree_digest(work)
    command = [sys.executable, "-m", "slim_mha.migration", "fold", "stock.safetensors", "out.safetensors"]
    result = _interrupted_at(_HOLD_IMPORT, command, work, module=module)
    assert (result.returncode, result.stdout) == (130, "")
    assert result.stderr == "python -m slim_mha.migration fold: interrupted; nothing was written\n"
    assert tree_digest(work) == before and os.listdir(work) == ["stock.safetensors"]


def test_ctrl_c_during_the_console_scripts_imports_is_one_line(tmp_path):
    script = shutil.which("slim-mha-migrate", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("slim-mha-migrate is not installed beside this Python")
    work = tmp_path / "work"
    work.mkdir()
    command = [script, "inspect", "missing.pt"]
    result = _interrupted_at(_HOLD_IMPORT, command, work, module="slim_mha.migration._migrate")
    assert (result.returncode, result.stdout) == (130, "")
    assert result.stderr == f"{PROG} inspect: interrupted; nothing was written\n"
    assert os.listdir(work) == []


def test_ctrl_c_while_python_shuts_down_after_the_run_changes_nothing(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    save_file(prefixed(stock_attention(), "attn."), work / "stock.safetensors")
    command = [sys.executable, "-m", "slim_mha.migration", "fold", "stock.safetensors", "out.safetensors"]
    result = _interrupted_at(_HOLD_SHUTDOWN, command, work)
    assert (result.returncode, result.stderr) == (0, "")
    size = format_size((work / "out.safetensors").stat().st_size)
    assert result.stdout.splitlines()[-1] == f"wrote out.safetensors (1 shard, 4 tensors, {size})"
    assert load_file(work / "out.safetensors")["attn.in_proj_bias"][8:16].count_nonzero() == 0


# ------------------------------------------------------------------------------------ truthful messages


def test_the_cli_and_the_api_each_speak_their_own_words(tmp_path, stock_file, capsys):
    (tmp_path / "out.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"already exists; pass force=True to replace it$"):
        migrate_module.migrate("fold", stock_file, tmp_path / "out.safetensors", migrate_module.MigrationOptions())
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors", "--zero-attn", ""], capsys)
    assert (code, err) == (
        1,
        f"{PROG} fold: error: --zero-attn '': expected a module name such as 'decoder.layers.0.self_attn'\n",
    )
    with pytest.raises(ValueError, match=r"^zero_attn '': expected a module name"):
        migrate_module.migrate(
            "fold", stock_file, tmp_path / "out.safetensors", migrate_module.MigrationOptions(zero_attn=[""])
        )


def test_escape_characters_in_paths_are_shown_escaped(tmp_path, stock_file, capsys):
    destination = tmp_path / "out\x1b[2K\r.pt"
    code, out, err = run_cli(["fold", stock_file, destination], capsys)
    assert code == 1 and out == ""
    assert err == (
        f"{PROG} fold: error: {tmp_path}/out\\x1b[2K\\r.pt: the output is one safetensors file, so DST "
        "must end in .safetensors\n"
    )


def test_a_write_failure_names_the_users_path_not_the_staging_path(tmp_path, sharded, capsys, monkeypatch):
    def disk_full(path, *args, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(output_module, "write_safetensors", disk_full)
    code, out, err = run_cli(["fold", sharded, tmp_path / "out"], capsys)
    assert (code, out) == (1, "")
    assert (
        err
        == f"{PROG} fold: error: {tmp_path / 'out'}: cannot write the output (No space left on device); nothing was written\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_ctrl_c_just_after_the_output_is_in_place_says_it_was_written(tmp_path, stock_file, capsys, monkeypatch):
    def interrupted_at(point):
        if point == "after-commit":
            raise KeyboardInterrupt

    monkeypatch.setattr(output_module, "pause_for_tests", interrupted_at)
    code, out, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)
    assert (code, out) == (130, "")
    assert err == f"{PROG} fold: interrupted after {tmp_path / 'out.safetensors'} was written completely\n"
    assert "attn" not in err and load_file(tmp_path / "out.safetensors")


def test_ctrl_c_before_the_swap_keeps_the_old_output_and_says_so(tmp_path, stock_file, capsys, monkeypatch):
    old = old_output(tmp_path / "out.safetensors")

    def interrupted_at(point):
        if point == "before-commit":
            raise KeyboardInterrupt

    monkeypatch.setattr(output_module, "pause_for_tests", interrupted_at)
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors", "--force"], capsys)
    assert code == 130
    out_path = tmp_path / "out.safetensors"
    assert err == f"{PROG} fold: interrupted; nothing was written: {out_path} was left as it was\n"
    assert out_path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "stock.safetensors"]


def test_a_bug_after_the_output_is_in_place_does_not_say_nothing_was_written(tmp_path, stock_file, capsys, monkeypatch):
    import slim_mha.migration.cli as cli_module

    def broken(report):
        raise TypeError("cannot format")

    monkeypatch.setattr(cli_module, "format_report", broken)
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors"], capsys)
    assert code == 1
    assert err == (
        f"{PROG} fold: internal error: TypeError: cannot format; {tmp_path / 'out.safetensors'} "
        "was written completely\n"
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line(tmp_path, stock_file):
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "slim_mha.migration", "fold", str(stock_file), str(tmp_path / "out.safetensors")],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=_environment(),
            timeout=120,
        )
    assert result.returncode == 1
    assert result.stderr == (
        "python -m slim_mha.migration fold: error: cannot print the report to stdout (No space left on device); "
        f"{tmp_path / 'out.safetensors'} was written completely\n"
    )
    assert load_file(tmp_path / "out.safetensors")["dec.attn.in_proj_bias"][8:16].count_nonzero() == 0


@pytest.mark.parametrize(
    "command",
    [["inspect", "{src}"], ["fold", "{src}", "{tmp}/out.safetensors", "--verify"]],
    ids=["inspect", "fold_verify"],
)
def test_a_bad_environment_gives_one_line_not_a_traceback(tmp_path, stock_file, command):
    environment = {**_environment(), "SLIM_MHA_CHECK_EQUIVARIANCE": "yes2"}
    argv = [arg.format(src=stock_file, tmp=tmp_path) for arg in command]
    result = subprocess.run(
        [sys.executable, "-m", "slim_mha.migration", *argv],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    # --verify builds torch's stock class only, so the variable (read by slim attention) plays no part.
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("how", [["--keep", "dec.attn"], ["--keep", "dec.*"], ["--keep-inexact"]])
def test_strip_keeps_the_modules_named_or_inexact_and_strips_the_rest(tmp_path, stock_file, capsys, how):
    out = tmp_path / "out.safetensors"
    code, report, err = run_cli(["strip", stock_file, out, "--verify", *how], capsys)
    assert (code, err) == (0, ""), err
    written, source = load_file(out), load_file(stock_file)
    assert {"enc.attn.q_proj_bias", "enc.attn.v_proj_bias"} <= written.keys() and "enc.attn.in_proj_bias" not in written
    for key in ("dec.attn.in_proj_bias", "dec.attn.bias_k", "dec.attn.bias_v", "dec.attn.in_proj_weight"):
        assert torch.equal(written[key], source[key]), key  # left exactly as it was
    reason = "--keep-inexact: bias_k is present" if how == ["--keep-inexact"] else "kept as it is (--keep)"
    assert reason in report and "dec.attn" in report


def test_keep_names_a_module_that_exists_and_applies_to_strip_only(tmp_path, stock_file, capsys):
    code, _, err = run_cli(["strip", stock_file, tmp_path / "out.safetensors", "--keep", "nope"], capsys)
    assert code == 1 and "--keep 'nope' matches no attention module; modules are named like" in err
    assert not (tmp_path / "out.safetensors").exists()
    code, _, err = run_cli(["fold", stock_file, tmp_path / "out.safetensors", "--keep", "dec.attn"], capsys)
    assert code == 2 and "unrecognized arguments: --keep" in err


def test_keep_in_the_python_api_and_a_strip_that_keeps_everything_has_nothing_to_do(tmp_path, stock_file):
    report = migration_package.strip_checkpoint(stock_file, tmp_path / "a.safetensors", keep_inexact=True)
    kept = [module for module in report.modules if "kept as it is" in module.action]
    assert [module.name for module in kept] == ["dec.attn"]
    with pytest.raises(migration_package.NothingToDo, match="nothing to do"):
        migration_package.strip_checkpoint(stock_file, tmp_path / "b.safetensors", keep=["*"])
    with pytest.raises(ValueError, match="apply to strip only"):
        migrate_module.migrate(
            "fold", stock_file, tmp_path / "c.safetensors", migrate_module.MigrationOptions(keep=("dec.attn",))
        )
