"""``slim-mha-migrate`` / ``python -m slim_mha.migration``: ``main`` wires the four subcommands together.

Usage mistakes exit with 2 through ``parser.error``; a run that fails (a bad file, a refusal, a
``--verify`` mismatch) prints one line naming the file and the key and exits with 1; a run with nothing
to do (the checkpoint is already in the layout asked for) says so and exits with 3. No traceback
reaches the user, whatever the input or the environment: anything unexpected is still one line.

SIGTERM and SIGHUP (what ``timeout``, docker and Slurm send) clean up like Ctrl-C, and exit with
128 + the signal's number. The line printed after an interruption or a failure says what exists on
disk at that moment: nothing new, or DST written completely (see ``_staging.Journal``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from . import (
    fold_checkpoint,
    format_report,
    inspect_checkpoint,
    strip_checkpoint,
    to_stock_checkpoint,
)
from ._staging import Journal, journal
from .report import NOTHING_TO_DO_STATUS, NothingToDo, cli_spelling, shown

PROG = "slim-mha-migrate"

_DESCRIPTION = """\
Migrate nn.MultiheadAttention checkpoints between the stock layout and slim_mha's, which stores no
key bias.

SRC, which is read and never modified, is one of:
  - a .safetensors file;
  - a .pt, .pth, .bin or .ckpt file written by torch.save: a state dict, or a checkpoint holding one
    under 'state_dict' (PyTorch Lightning) or 'model'. It is loaded with torch.load(weights_only=True),
    so a pickle that needs anything but tensors is refused unread; this needs a torch release >= 2.10.0
    (older weights-only unpicklers can be made to run code), else save the weights as safetensors;
  - a sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json or any
    other *.index.json), whose shards, .safetensors or torch files as above, sit beside it;
  - a folder holding one of those two indexes, or exactly one weight file under any name;
  - a torch.distributed.checkpoint (DCP) folder (.metadata and *.distcp files, as dcp.save writes it
    under FSDP2 or in one process), read in one process; its chunks are torch pickles, as above.

For a DCP folder, DST is a DCP folder that dcp.load reads (a stripped one with
slim_mha.migration.StrippedLoadPlanner), every entry the run leaves alone copied byte for byte;
--to safetensors writes safetensors shards and an index instead. For any other SRC, DST is
safetensors: a .safetensors file for a file SRC. For an index or a folder, DST is a
folder: each shard is written as .safetensors under its Hugging Face name (pytorch_model.bin becomes
model.safetensors, pytorch_model-00001-of-00002.bin model-00001-of-00002.safetensors, and
pytorch_model.bin.index.json model.safetensors.index.json), and the other files of SRC's folder
(config.json, tokenizer files, README...; not subfolders, not other weight files, not files that
symbolic links take outside SRC) are copied unchanged unless --no-companions. DST appears complete
or not at all, with the permission bits of its source (as cp -p), and never inside SRC.

Exit status: 0 written (or planned, with --dry-run); 1 failed, nothing written unless the message says
so; 2 a usage mistake; 3 nothing to do: SRC is already in the layout asked for, nothing was written (a
pipeline that re-runs its migration can treat 3 as done); 128 + N stopped by signal N."""

_SUBCOMMANDS = {
    "strip": (
        "a file without the key bias, for slim only (refuses modules with bias_k or add_zero_attn)",
        """\
Write the key-bias-free layout: in_proj_bias becomes q_proj_bias and v_proj_bias, and the key bias
leaves the file. Use it for a file without the key bias when only slim_mha will load it; stock
nn.MultiheadAttention cannot (to-stock converts it back). Exact unless tokens are appended after the
projection: modules with bias_k, or marked --zero-attn, are refused with a pointer to `fold`, unless
--keep-inexact leaves them as they are; --keep leaves any module you name as it is.""",
        """\
examples:
  {prog} strip model.safetensors model.slim.safetensors
  {prog} strip ckpt/ ckpt-slim/ --verify
  {prog} strip model.safetensors model.slim.safetensors --keep memory_tokens --keep 'decoder.*.cross_attn'
  {prog} strip model.safetensors model.slim.safetensors --keep-inexact
  {prog} strip model.pt model.slim.safetensors --dry-run""",
    ),
    "fold": (
        "a checkpoint stock and slim both load, exact: zero the key bias slot, folding it where it matters",
        """\
Write stock's layout with the key slot of every in_proj_bias zeroed: stock nn.MultiheadAttention and
slim_mha both load the result (strict=True) and compute the original outputs. Use it when the file
must stay loadable by stock. Where add_bias_kv appended a key, b_k is folded into bias_k
(bias_k - b_k); modules marked --zero-attn need their key bias and are left as stock has them. A
key-bias-free (strip) input is turned back into stock's layout.""",
        """\
examples:
  {prog} fold model.safetensors model.folded.safetensors --verify
  {prog} fold ckpt/model.safetensors.index.json ckpt-folded/ --zero-attn 'decoder.layers.*.self_attn'
  {prog} fold model.safetensors model.eval.safetensors --fold-value-bias
  {prog} fold fsdp-checkpoint/ fsdp-checkpoint.folded/ --verify   # a DCP folder, for dcp.load""",
    ),
    "to-stock": (
        "convert slim modules back to the stock layout (loads into nn.MultiheadAttention, strict=True)",
        """\
Convert slim modules back to the stock layout: stock nn.MultiheadAttention loads the result with
strict=True and computes the same outputs. The dropped key bias returns as a zero slice.""",
        """\
examples:
  {prog} to-stock model.slim.safetensors model.stock.safetensors --verify
  {prog} to-stock ckpt-slim/ ckpt-stock/ --force""",
    ),
    "inspect": (
        "list the attention modules and what strip, fold and to-stock would do",
        """\
List every attention module found by its key prefix: layout, shapes, dtype, whether the key bias is
present and non-zero, and what strip, fold and to-stock would do to it.""",
        """\
examples:
  {prog} inspect model.safetensors
  {prog} inspect ckpt/ --zero-attn 'decoder.layers.*.self_attn'""",
    ),
}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{strip,fold,to-stock,inspect}")
    for name, (summary, description, examples) in _SUBCOMMANDS.items():
        sub = subparsers.add_parser(
            name,
            help=summary,
            description=description,
            epilog=examples.format(prog=prog),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument(
            "source",
            metavar="SRC",
            help="checkpoint to read: a .safetensors, .pt, .pth, .bin or .ckpt file, an "
            "*.index.json, or a checkpoint folder (the top-level --help says what each may hold)",
        )
        if name != "inspect":
            sub.add_argument("destination", metavar="DST", help="a .safetensors file, or a directory for a sharded SRC")
            _add_run_options(sub, fold_value=name != "to-stock")
        if name == "strip":
            _add_keep(sub)
        _add_zero_attn(sub)
        sub.set_defaults(parser=sub)
    return parser


def _add_run_options(sub: argparse.ArgumentParser, *, fold_value: bool) -> None:
    sub.add_argument(
        "--verify",
        action="store_true",
        help="rebuild every changed module from the original and the migrated tensors and compare their "
        "outputs on random inputs, then read every written file back and compare every tensor with the "
        "source or its conversion; any mismatch fails and nothing is written. It assumes unmarked stock "
        "modules were built without add_zero_attn, and says so",
    )
    sub.add_argument("--dry-run", action="store_true", help="check and plan (and verify), but write nothing")
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it exists and this tool wrote it: a file only if it is a safetensors file with "
        "slim_mha metadata, a directory only if every entry is a file this run writes and that is ours "
        "(shards and index with slim_mha metadata, companion files an earlier run wrote and nobody "
        "changed); anything else, another model's checkpoint above all, is named and nothing is touched",
    )
    sub.add_argument(
        "--follow-outside-links",
        action="store_true",
        help="copy companion files, and read shards, whose symbolic links lead outside SRC's folder "
        "(left out, or refused, by default; a Hugging Face cache snapshot's blobs count as inside)",
    )
    sub.add_argument(
        "--allow-expand",
        action="store_true",
        help="write a torch file whose tensors, written out, take far more than the file stores "
        "(views that repeat a small tensor); refused by default before anything is written",
    )
    sub.add_argument(
        "--no-companions",
        dest="companions",
        action="store_false",
        help="do not copy the non-weight files of a checkpoint folder (config.json, tokenizer files, "
        "README...) into the output folder",
    )
    sub.add_argument(
        "--to",
        choices=("dcp", "safetensors"),
        help="the output's format for a DCP folder (default: a DCP folder, which dcp.load reads; a stripped "
        "one with slim_mha.migration.StrippedLoadPlanner): safetensors writes shards and an index instead",
    )
    if fold_value:
        sub.add_argument(
            "--fold-value-bias",
            action="store_true",
            help="also fold the value bias into out_proj.bias; exact for inference (eval) only: with "
            "attention dropout (training) the outputs differ. fold leaves a zero value slot in in_proj_bias; "
            "strip's output has no v_proj_bias: load it into a slim model after "
            "slim_mha.fold_value_bias(model.eval())",
        )
    sub.add_argument("--quiet", action="store_true", help="print nothing on success and show no progress bar")


def _add_modules(sub: argparse.ArgumentParser, flag: str, what: str) -> None:
    """A repeatable option that names modules: a name as inspect lists it, or a glob."""
    sub.add_argument(
        flag,
        action="append",
        default=[],
        metavar="MODULE",
        help=f"{what}: a name as inspect lists it, or a glob such as 'decoder.layers.*.self_attn'; repeatable",
    )


def _add_keep(sub: argparse.ArgumentParser) -> None:
    _add_modules(sub, "--keep", "leave this module as it is (its key bias stays; the report names each one kept)")
    sub.add_argument(
        "--keep-inexact",
        action="store_true",
        help="leave as they are the modules strip cannot convert exactly (bias_k, --zero-attn) instead of "
        "refusing the file, and strip the rest; the report names each module kept, and why",
    )


def _add_zero_attn(sub: argparse.ArgumentParser) -> None:
    _add_modules(sub, "--zero-attn", "mark a module built with add_zero_attn=True, which a checkpoint cannot record")


def _version() -> str:
    from slim_mha import __version__  # the package's own module: no torch import

    return __version__


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; an unknown option after a subcommand gets that subcommand's usage, and the closest option."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub: argparse.ArgumentParser = args.parser
        options = [option for action in sub._actions for option in action.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0], options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """Run the CLI; returns 0, or exits with 1 (failed run), 2 (usage), 3 (nothing to do) or 128 + N
    (signal N) and one line on stderr.

    Without ``argv`` it runs as the program, on ``sys.argv`` (both entry points call it so): Ctrl-C,
    SIGTERM and SIGHUP are then ignored once the run is over, so that a Ctrl-C while Python shuts down
    (torch takes a while) can neither print a traceback nor change the exit code.
    """
    # The handlers go in first: torch (seconds to import) is imported by the run itself, inside the
    # guard below, so a Ctrl-C while it loads is one line too, not a traceback from the import.
    with _Interrupts(until_exit=argv is None) as interrupts, cli_spelling(), journal() as record:
        try:
            args = _parse(build_parser(prog), argv)
        except KeyboardInterrupt:
            interrupts.armed = False
            sys.stderr.write(f"{prog}: {_interrupted(record)}\n")
            sys.exit(128 + interrupts.signal)
        sub: argparse.ArgumentParser = args.parser
        try:
            report = _run(args)
            if args.command == "inspect" or not args.quiet:
                _print(format_report(report), sub, record)
            interrupts.armed = False
        except KeyboardInterrupt:
            interrupts.armed = False
            sub.exit(128 + interrupts.signal, f"{sub.prog}: {_interrupted(record)}\n")
        except NothingToDo as exc:
            interrupts.armed = False
            sub.exit(NOTHING_TO_DO_STATUS, f"{sub.prog}: {_one_line(exc)}\n")
        except (OSError, ValueError, RuntimeError) as exc:
            interrupts.armed = False
            sub.exit(1, f"{sub.prog}: error: {_one_line(exc)}{_written(record)}\n")
        except Exception as exc:  # a bug, or a broken environment: still one line, and a way to report it
            interrupts.armed = False
            state = _written(record) or "; nothing was written"
            sub.exit(1, f"{sub.prog}: internal error: {type(exc).__name__}: {_one_line(exc)}{state}\n")
    return 0


def _print(text: str, sub: argparse.ArgumentParser, record: Journal) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader left early (`| head`): not an error
        _silence_stdout()
    except OSError as exc:  # stdout is a full disk (`> /dev/full`) or gone
        _silence_stdout()
        state = _written(record) or "; nothing was written"
        sub.exit(1, f"{sub.prog}: error: cannot print the report to stdout ({exc.strerror or exc}){state}\n")


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit does not fail a second time, with a traceback."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _interrupted(record: Journal) -> str:
    if record.committed:
        return f"interrupted after {shown(record.destination or 'DST')} was written completely{_leftovers(record)}"
    if record.destination is not None and os.path.lexists(record.destination):
        return f"interrupted; nothing was written: {shown(record.destination)} was left as it was{_leftovers(record)}"
    return f"interrupted; nothing was written{_leftovers(record)}"


def _written(record: Journal) -> str:
    """What a failure after the output was moved into place must not hide."""
    if not record.committed:
        return _leftovers(record)
    return f"; {shown(record.destination or 'DST')} was written completely{_leftovers(record)}"


def _leftovers(record: Journal) -> str:
    return "".join(f"; left {shown(path)}, which the next run removes" for path in record.leftovers)


class _Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP (what ``timeout``, docker and Slurm send) all raise KeyboardInterrupt,
    so every way of stopping a run cleans up the same way. Only the first one raises, and only while
    the run is ``armed``: a second Ctrl-C cannot cut the cleanup short, nor a late one the message.
    ``until_exit``: the process ends after the run, so the signals are then ignored instead of restored
    (SIG_IGN, which Python keeps while it shuts down, whereas it resets its own handlers early on)."""

    _NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self, *, until_exit: bool = False) -> None:
        self.armed = True
        self.until_exit = until_exit
        self.signal = signal.SIGINT  # the one that stopped the run: the exit code is 128 + its number
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL or SIG_IGN

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread; Ctrl-C still works
        for name in self._NAMES:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            current = signal.getsignal(signum)
            if current is signal.SIG_IGN or (name == "SIGINT" and current is not signal.default_int_handler):
                continue  # nohup stays nohup, and a caller's own Ctrl-C handler stays theirs
            self._previous[signum] = signal.signal(signum, self._interrupt)
        return self

    def __exit__(self, *exc_info) -> None:
        self.armed = False  # also after a usage error or --help, which leave through SystemExit
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if self.until_exit else handler)

    def _interrupt(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            self.signal = signum
            raise KeyboardInterrupt


def _run(args: argparse.Namespace):
    if args.command == "inspect":
        return inspect_checkpoint(args.source, zero_attn=args.zero_attn)
    options = dict(
        zero_attn=args.zero_attn,
        verify=args.verify,
        dry_run=args.dry_run,
        force=args.force,
        companions=args.companions,
        progress=False if args.quiet else None,
        follow_outside_links=args.follow_outside_links,
        allow_expand=args.allow_expand,
        to=args.to,
    )
    if args.command == "to-stock":
        return to_stock_checkpoint(args.source, args.destination, **options)
    if args.command == "strip":
        return strip_checkpoint(
            args.source,
            args.destination,
            fold_value_bias=args.fold_value_bias,
            keep=args.keep,
            keep_inexact=args.keep_inexact,
            **options,
        )
    return fold_checkpoint(args.source, args.destination, fold_value_bias=args.fold_value_bias, **options)


def _one_line(exc: BaseException) -> str:
    """The message on one line, with any control character a module forgot to escape shown escaped."""
    return shown(" ".join(str(exc).split())) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
