"""``slim-mha-migrate`` / ``python -m slim_mha.migration``: ``main`` wires the four subcommands together.

Usage mistakes exit with 2 through ``parser.error``; a run that fails (a bad file, a refusal, a
``--verify`` mismatch) prints one line naming the file and the key and exits with 1. No traceback
reaches the user.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import fold_checkpoint, format_report, inspect_checkpoint, strip_checkpoint, to_stock_checkpoint

PROG = "slim-mha-migrate"

_DESCRIPTION = """\
Migrate nn.MultiheadAttention checkpoints between the stock layout and slim_mha's, which stores no
key bias. SRC is a .safetensors file, a directory with model.safetensors.index.json (or that index),
or a .pt/.pth/.bin state dict (loaded with weights_only=True). The output is safetensors, sharded as
the input was. SRC is never modified, and DST appears complete or not at all."""

_SUBCOMMANDS = {
    "strip": (
        "drop the key bias where that is exact (refuses modules with bias_k or add_zero_attn)",
        """\
Drop the key slice of every in_proj_bias. Exact unless tokens are appended after the projection:
modules with bias_k, or marked --zero-attn, are refused with a pointer to `fold`.""",
        """\
examples:
  {prog} strip model.safetensors model.slim.safetensors
  {prog} strip ckpt/ ckpt-slim/ --verify
  {prog} strip model.pt model.slim.safetensors --dry-run""",
    ),
    "fold": (
        "convert every module to the slim layout exactly, folding the key bias where it matters",
        """\
Convert every stock module to the slim layout, exactly: the key bias is dropped, folded into bias_k
(bias_k - b_k) where add_bias_kv appended a key, and kept as k_proj_bias in modules marked
--zero-attn.""",
        """\
examples:
  {prog} fold model.safetensors model.slim.safetensors --verify
  {prog} fold ckpt/model.safetensors.index.json ckpt-slim/ --zero-attn 'decoder.layers.*.self_attn'
  {prog} fold model.safetensors model.eval.safetensors --fold-value-bias""",
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
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{strip,fold,to-stock,inspect}")
    for name, (summary, description, examples) in _SUBCOMMANDS.items():
        sub = subparsers.add_parser(
            name,
            help=summary,
            description=description,
            epilog=examples.format(prog=prog),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument("source", metavar="SRC", help="checkpoint to read")
        if name != "inspect":
            sub.add_argument("destination", metavar="DST", help="a .safetensors file, or a directory for a sharded SRC")
            _add_run_options(sub, fold_value=name != "to-stock")
        _add_zero_attn(sub)
        sub.set_defaults(parser=sub)
    return parser


def _add_run_options(sub: argparse.ArgumentParser, *, fold_value: bool) -> None:
    sub.add_argument(
        "--verify",
        action="store_true",
        help="rebuild every changed module from the original and the migrated tensors and compare their "
        "outputs on random inputs; any mismatch fails and nothing is written",
    )
    sub.add_argument("--dry-run", action="store_true", help="check and plan (and verify), but write nothing")
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it exists (a directory only if it holds nothing but checkpoint files)",
    )
    if fold_value:
        sub.add_argument(
            "--fold-value-bias",
            action="store_true",
            help="also fold the value bias into out_proj.bias; exact for inference (eval) only: with "
            "attention dropout (training) the outputs differ",
        )
    sub.add_argument("--quiet", action="store_true", help="print nothing on success and show no progress bar")


def _add_zero_attn(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--zero-attn",
        action="append",
        default=[],
        metavar="MODULE",
        help="mark a module built with add_zero_attn=True, which a checkpoint cannot record: a name as "
        "inspect lists it, or a glob such as 'decoder.layers.*.self_attn'; repeatable",
    )


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """Run the CLI; returns 0, or exits with 1 (failed run) or 2 (usage) and one line on stderr."""
    args = build_parser(prog).parse_args(argv)
    sub: argparse.ArgumentParser = args.parser
    try:
        report = _run(args)
    except KeyboardInterrupt:
        sub.exit(130, f"{sub.prog}: interrupted; nothing was written\n")
    except (OSError, ValueError, RuntimeError) as exc:
        sub.exit(1, f"{sub.prog}: error: {_one_line(exc)}\n")
    except Exception as exc:  # a bug: still one line, and a way to report it
        sub.exit(1, f"{sub.prog}: internal error: {type(exc).__name__}: {_one_line(exc)}; nothing was written\n")
    if args.command == "inspect" or not args.quiet:
        try:
            print(format_report(report), flush=True)
        except BrokenPipeError:  # the reader left early (`| head`): quiet the flush at exit, not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _run(args: argparse.Namespace):
    if args.command == "inspect":
        return inspect_checkpoint(args.source, zero_attn=args.zero_attn)
    options = dict(
        zero_attn=args.zero_attn,
        verify=args.verify,
        dry_run=args.dry_run,
        force=args.force,
        progress=False if args.quiet else None,
    )
    if args.command == "to-stock":
        return to_stock_checkpoint(args.source, args.destination, **options)
    convert = strip_checkpoint if args.command == "strip" else fold_checkpoint
    return convert(args.source, args.destination, fold_value_bias=args.fold_value_bias, **options)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
