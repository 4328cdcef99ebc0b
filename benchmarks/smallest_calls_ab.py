"""The smallest calls against stock and against slim at an earlier commit, in one process.

    python benchmarks/smallest_calls_ab.py [--against 794b84a] [--skip-unread-weights] [--forwarded] [--repeats 21] [--threads 2] [--busy N] [--shape 2x16x64x4 ...]

At B=2 L=16 a call takes tens of microseconds, and a microsecond of slim's own Python is a percent
of it: a change to the code that chooses a call's path shows here first. The slim_mha package of
``--against`` (``git archive`` of this repository, so it needs the commit in the clone) is unpacked
under another name into a temporary folder and imported beside the working tree's, so the three
contenders are timed interleaved in one process (``slim_mha.bench.measure.timing``), the allocator
warm, beside ``--busy`` busy processes: stock ``nn.MultiheadAttention``, slim then, slim now, all on
the same weights and inputs. Cases: inference (eval, ``inference_mode``) and a training step
(forward and backward), without and with a key padding mask (the last quarter of the keys of every
other sequence), without and with weights. Every call site reads the output alone
(``attn(x, x, x, need_weights=..., key_padding_mask=...)[0]``), so ``--skip-unread-weights`` adds slim
now built with that option ("skip"), which skips the weights there; ``--forwarded`` passes the
arguments on as ``**keywords`` instead, where slim cannot prove that the weights go unread. Printed per case: the median microseconds, and the paired ratios
stock/now, then/now and stock/skip (above 1, the second is faster).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch
from _script import parse_script_arguments, script_parser
from torch import nn

from slim_mha import SlimMultiheadAttention
from slim_mha.bench.matrix.cases import parse_shape
from slim_mha.bench.matrix.contenders import case_masks
from slim_mha.bench.measure.allocator import allocator_state
from slim_mha.bench.measure.load import competing_load
from slim_mha.bench.measure.timing import Settings, measure, median_of_ratios

SHAPES = ("2x16x64x4",)
REPOSITORY = Path(__file__).resolve().parents[1]


def slim_at(commit: str, folder: Path) -> type:
    """``SlimMultiheadAttention`` of ``commit``: its package unpacked as ``slim_mha_then`` in ``folder``.

    The package imports itself relatively, so the copy runs as it ran then; only its optional
    features (loaded by absolute name) would come from the working tree, and no case here loads one.
    """
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", commit, "slim_mha"], capture_output=True, check=False
    )
    if archive.returncode:
        sys.exit(
            f"--against {commit}: git archive failed ({archive.stderr.decode().strip()}); give a commit of this clone"
        )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as unpacked:
        # The filter argument came with Python 3.11.4; the archive is this clone's own either way.
        unpacked.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (folder / "slim_mha").rename(folder / "slim_mha_then")
    sys.path.insert(0, str(folder))
    return importlib.import_module("slim_mha_then").SlimMultiheadAttention


def call_site(forwarded: bool):
    """The line that calls attention and keeps its output alone. Written out, slim_mha can prove that
    the weights are discarded; ``forwarded`` (``**keywords``, as a library passes its caller's
    arguments on) it cannot, and the weights are computed as asked."""
    if forwarded:
        return lambda module, x, need_weights, padding: module(
            x, x, x, **{"need_weights": need_weights, "key_padding_mask": padding}
        )[0]
    return lambda module, x, need_weights, padding: module(
        x, x, x, need_weights=need_weights, key_padding_mask=padding
    )[0]


def contenders(modules: dict[str, nn.Module], shape, mode: str, masked: bool, weights: bool, forwarded: bool) -> dict:
    """``{name: (step, reset)}`` for one case, every module on the same inputs."""
    batch, length, width, _ = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, width, generator=generator).requires_grad_(mode == "train")
    grad = torch.randn(batch, length, width, generator=generator)
    padding = case_masks("padding" if masked else "none", batch, length, x.device).get("key_padding_mask")
    attend = call_site(forwarded)

    def step_of(module: nn.Module):
        module.train(mode == "train")
        if mode == "inference":

            def infer() -> None:
                with torch.inference_mode():
                    attend(module, x, weights, padding)

            return infer, lambda: None

        def train() -> None:
            out = attend(module, x, weights, padding)
            out.backward(grad)

        def reset() -> None:
            x.grad = None
            module.zero_grad(set_to_none=True)

        return train, reset

    return {name: step_of(module) for name, module in modules.items()}


def main() -> None:
    parser = script_parser(__doc__, SHAPES)
    parser.add_argument("--against", default="794b84a", metavar="COMMIT", help="slim then (default: 794b84a)")
    parser.add_argument(
        "--skip-unread-weights", action="store_true", help="also slim now built with skip_unread_weights=True"
    )
    parser.add_argument(
        "--forwarded", action="store_true", help="call through **keywords, where slim cannot prove the weights unread"
    )
    args = parse_script_arguments(parser)
    with tempfile.TemporaryDirectory() as folder:
        then = slim_at(args.against, Path(folder))
        print(f"then: slim_mha at {args.against}; now: the working tree")
        with competing_load(args.busy, 1800), allocator_state("warm"):
            for text in args.shape or SHAPES:
                shape = parse_shape(text)
                torch.manual_seed(0)
                stock = nn.MultiheadAttention(shape[2], shape[3], batch_first=True)
                with torch.no_grad():  # trained-looking biases, the key slice included
                    stock.in_proj_bias.normal_(std=0.1)
                    stock.out_proj.bias.normal_(std=0.1)
                modules = {"stock": stock}
                builds = [("then", then, {}), ("now", SlimMultiheadAttention, {})]
                if args.skip_unread_weights:
                    builds.append(("skip", SlimMultiheadAttention, {"skip_unread_weights": True}))
                for name, cls, options in builds:
                    modules[name] = cls(shape[2], shape[3], batch_first=True, **options)
                    modules[name].load_state_dict(stock.state_dict())
                for mode in ("inference", "train"):
                    for masked in (False, True):
                        for weights in (False, True):
                            steps = contenders(modules, shape, mode, masked, weights, args.forwarded)
                            timed = measure(steps, torch.device("cpu"), Settings(repeats=args.repeats))
                            samples = {name: summary.samples_ms for name, summary in timed.items()}
                            us = "  ".join(f"{name} {summary.median_ms * 1e3:7.1f}" for name, summary in timed.items())
                            pairs = [("stock", "now"), ("then", "now")] + [("stock", "skip")] * ("skip" in samples)
                            ratios = ", ".join(
                                f"{a}/{b} {median_of_ratios(samples[a], samples[b]):.3f}x" for a, b in pairs
                            )
                            label = f"{mode:<9} {'padding' if masked else '-':<7} {'w' if weights else '-'}"
                            print(f"B={shape[0]} L={shape[1]} E={shape[2]} H={shape[3]} {label}  us {us};  {ratios}")
    print("paired a/b: the median over interleaved repeats of a's time over b's (above 1, b is faster)")


if __name__ == "__main__":
    main()
