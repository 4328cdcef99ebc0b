"""``python -m slim_mha.bench model MODULE:CALLABLE``: what patching does to a user's own model.

The callable is called with no arguments twice, once as it is and once under
``slim_mha.patched()``; the patched model loads the first one's state dict, so both hold the same
weights. The command then checks that they agree (eval outputs, and the gradients of one training
step on the sum of squares of the first output tensor, dropout zeroed, the key slot of every
``in_proj_bias`` left out since slim gives it no gradient), each against a float64 run of the
stock model, and times inference and a training step of both interleaved, with their peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import itertools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..measure.allocator import allocator_state
from ..measure.compiled import graph_breaks
from ..measure.memory import profile_step, saved_tensor_bytes
from ..measure.options import (
    add_device_option,
    add_timing_options,
    device_and_settings,
    subcommand,
)
from ..measure.output import write_json
from ..measure.timing import Settings, measure, paired_summary

__all__ = ["MODES", "ModelInputError", "ModelRun", "add_parser", "benchmark_model", "run"]

_EXAMPLES = """\
examples:
  python -m slim_mha.bench model torchvision.models:vit_b_16 --input 2x3x224x224
  python -m slim_mha.bench model my_project.models:build_model --input-fn my_project.data:example_batch
  python -m slim_mha.bench model torch.nn:Transformer --input 10x2x512 --input 7x2x512 --json out/model.json
"""
MODES = ("inference", "train")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Slim may be this many times as far from the float64 run as stock is, plus FLOOR of the scale.
_STOCK_ERROR_FACTOR = 2.0
_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


class ModelInputError(ValueError):
    """Bad input to the command: one line that names the argument and the fix."""


def _resolve(target: str, option: str) -> Callable:
    """``"package.module:name.attr"`` -> the object, or a one-line error naming ``option``."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ModelInputError(f"{option} {target!r}: write it as MODULE:CALLABLE, e.g. torchvision.models:vit_b_16")
    try:
        value = importlib.import_module(module_name)
    except Exception as error:  # not installed, or installed but failing (built for another torch, say)
        fix = (
            "install it, or run from the folder that holds it"
            if isinstance(error, ImportError)
            else "install a build of it that matches this torch"
        )
        raise ModelInputError(
            f"{option} {target!r}: importing {module_name!r} failed ({type(error).__name__}: {error}); {fix}"
        ) from None
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ModelInputError(
                f"{option} {target!r}: {module_name!r} has no attribute {attribute!r}; check the name"
            )
        value = getattr(value, part)
    if not callable(value):
        raise ModelInputError(f"{option} {target!r}: {attribute!r} is a {type(value).__name__}, not a callable")
    return value


# Who runs the model: stock, slim under ``patched()``, and with --skip-unread-weights slim skipping
# the weights its callers never read.
_PATCHED = {"slim": None, "slim_skip": True}  # name -> skip_unread_weights; stock is built unpatched


def _build(factory: Callable, target: str, name: str) -> nn.Module:
    import slim_mha

    torch.manual_seed(0)
    try:
        with slim_mha.patched(skip_unread_weights=_PATCHED[name]) if name in _PATCHED else contextlib.nullcontext():
            model = factory()
    except Exception as error:  # the user's code: say whose it is
        raise ModelInputError(
            f"{target} failed when called with no arguments: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelInputError(
            f"{target} returned a {type(model).__name__}, not an nn.Module: give a callable that builds the model"
        )
    return model


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) <= 0:
        raise ModelInputError(f"--input {text!r}: a shape is positive integers joined by x, e.g. 2x3x224x224")
    return shape


def _inputs(shapes: list[str], input_fn: str | None, dtype: torch.dtype, device: torch.device) -> tuple:
    """Random inputs of the ``--input`` shapes, or what ``--input-fn`` returns, given those shapes."""
    parsed = [_shape(text) for text in shapes]
    if input_fn is not None:
        value = _resolve(input_fn, "--input-fn")(*parsed)
        args = value if isinstance(value, tuple) else (value,)
    else:
        generator = torch.Generator().manual_seed(0)
        args = tuple(torch.randn(shape, generator=generator) for shape in parsed)
    return tuple(pytree.tree_map(lambda x: _cast(x, dtype, device), arg) for arg in args)


def _cast(x, dtype: torch.dtype, device: torch.device):
    if not isinstance(x, Tensor):
        return x
    return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)


def _first_tensor(output) -> Tensor:
    leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
    if not leaves and hasattr(output, "__dict__"):  # a dataclass or plain object pytree does not know
        leaves = [leaf for leaf in pytree.tree_leaves(dict(vars(output))) if isinstance(leaf, Tensor)]
    if not leaves:
        raise ModelInputError(
            f"the model returned {type(output).__name__} with no tensor in it: nothing to compare or train"
        )
    return leaves[0]


def _without_dropout(model: nn.Module) -> nn.Module:
    """A copy whose dropout is zero: layers, and attention's own."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def _key_slots(model: nn.Module) -> dict[str, slice]:
    """The key slot of each attention's packed bias, by parameter name: slim gives it no gradient."""
    return {
        f"{name}.in_proj_bias" if name else "in_proj_bias": slice(module.embed_dim, 2 * module.embed_dim)
        for name, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention) and module.in_proj_bias is not None
    }


def _run_step(model: nn.Module, args: tuple, train: bool) -> dict[str, Tensor]:
    if not train:
        with torch.no_grad():
            return {"output": _first_tensor(model.eval()(*args)).detach()}
    model.train().zero_grad(set_to_none=True)
    output = _first_tensor(model(*args))
    output.float().square().sum().backward()
    tensors = {"output": output.detach()}
    tensors.update({name: p.grad.detach() for name, p in model.named_parameters() if p.grad is not None})
    return tensors


def _agreement(models: dict[str, nn.Module], args: tuple) -> dict:
    """Eval outputs and one training step's gradients of every model, each against a float64 run of stock.

    Each tensor's entry holds ``stock_error``, the ``bound`` slim's must stay within, and each slim
    model's error as ``<name>_error``.
    """
    plain = {name: _without_dropout(model) for name, model in models.items()}
    reference = copy.deepcopy(plain["stock"]).double()
    exact_args = tuple(
        pytree.tree_map(lambda x: x.double() if isinstance(x, Tensor) and x.is_floating_point() else x, a) for a in args
    )
    slots = _key_slots(plain["stock"])
    worst, agrees = {}, True
    for train in (False, True):
        runs = {name: _run_step(model, args, train) for name, model in plain.items()}
        exact_run = _run_step(reference, exact_args, train)
        for tensor, exact in exact_run.items():
            keep: slice | Tensor = slice(None)
            if tensor in slots:  # slim never trains the key slot: compare the query and value slots
                keep = torch.ones(exact.shape[0], dtype=torch.bool, device=exact.device)
                keep[slots[tensor]] = False
            exact = exact[keep].double()
            scale = max(1.0, exact.abs().max().item()) if exact.numel() else 1.0
            errors = {
                name: (run[tensor][keep].double() - exact).abs().max().item() if exact.numel() else 0.0
                for name, run in runs.items()
            }
            bound = _STOCK_ERROR_FACTOR * errors["stock"] + _FLOOR[runs["stock"][tensor].dtype] * scale
            worst[f"{'train' if train else 'eval'} {tensor}"] = {
                **{f"{name}_error": error for name, error in errors.items()},
                "bound": bound,
            }
            agrees &= all(error <= bound for name, error in errors.items() if name != "stock")
    return {"agrees": agrees, "errors": worst}


def _census(slim: nn.Module, args: tuple) -> dict[str, list[dict]]:
    """Which path each slim call takes in one forward, eval and training (``slim_mha.explain``)."""
    from slim_mha import explain

    census = {}
    for mode in ("eval", "train"):
        model = slim.train(mode == "train")
        with torch.no_grad() if mode == "eval" else contextlib.nullcontext():
            counts = explain(model, *args).census()
        census[mode] = [{"kind": k, "path": p, "why": w, "calls": n} for (k, p, w), n in counts.items()]
    slim.eval()
    return census


def _timed(models: dict[str, nn.Module], args: tuple, modes: tuple[str, ...], settings: Settings, device) -> dict:
    """Per mode: each model's median ms, peak (and saved) bytes, and the paired ratio of every pair."""
    results = {}
    inputs = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, Tensor)]
    for mode in modes:
        calls = {name: _step_and_reset(model, args, mode) for name, model in models.items()}
        peaks, saved = {}, {}
        for name, (step, reset) in calls.items():
            reset()
            step()  # warm
            reset()
            peaks[name] = profile_step(step, device).peak_bytes
            if mode == "train":  # what autograd keeps for backward, parameters and inputs left out
                reset()
                saved[name] = saved_tensor_bytes(step, list(models[name].parameters()) + inputs)
        summaries = measure(calls, device, settings)
        stalled = sorted(name for name, summary in summaries.items() if summary.stalled)
        samples = {name: summary.samples_ms for name, summary in summaries.items()}
        results[mode] = {
            "ms": {name: summary.median_ms for name, summary in summaries.items()},
            "paired": {
                f"{a}_over_{b}": None if stalled else paired_summary(samples[a], samples[b])
                for a, b in itertools.combinations(models, 2)
            },
            "stalled": stalled,
            "peak_bytes": peaks,
            **({"saved_bytes": saved} if saved else {}),
        }
    return results


def _step_and_reset(model: nn.Module, args: tuple, mode: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """One timed step of ``model`` in ``mode`` (inference or train), and what clears it between samples."""
    model.train(mode == "train")

    def infer() -> None:
        with torch.inference_mode():
            model(*args)

    def train() -> None:
        _first_tensor(model(*args)).float().square().sum().backward()

    return (infer, lambda: None) if mode == "inference" else (train, lambda: model.zero_grad(set_to_none=True))


@dataclass(frozen=True)
class ModelRun:
    """What to run of a user's model beside the model itself: its inputs, and how to run it."""

    shapes: tuple[str, ...] = ()
    input_fn: str | None = None
    dtype: torch.dtype = torch.float32
    modes: tuple[str, ...] = MODES
    skip_unread_weights: bool = False  # also slim with skip_unread_weights=True, as "slim_skip"
    compile_backend: str | None = None  # time every model under torch.compile with this backend


def benchmark_model(target: str, run: ModelRun, settings: Settings, device: torch.device) -> dict:
    """Build, compare and time; raises :class:`ModelInputError` for what the user must fix.

    Under ``compile_backend`` each model is counted for graph breaks first; the comparison and the
    census stay eager.
    """
    from slim_mha import SlimMultiheadAttention

    factory = _resolve(target, "MODULE:CALLABLE")
    if not run.shapes and run.input_fn is None:
        raise ModelInputError("give the model's inputs: --input SHAPE (one per argument) or --input-fn MODULE:CALLABLE")
    names = ("stock", "slim", "slim_skip") if run.skip_unread_weights else ("stock", "slim")
    models = {name: _build(factory, target, name).to(device=device, dtype=run.dtype) for name in names}
    for name in names[1:]:
        try:
            models[name].load_state_dict(models["stock"].state_dict())
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0]
            raise ModelInputError(
                f"{target}: the two builds differ, so weights cannot be shared ({first}); build the model deterministically"
            ) from None
    swapped = sum(isinstance(module, SlimMultiheadAttention) for module in models["slim"].modules())
    if not swapped:
        held = any(isinstance(module, nn.MultiheadAttention) for module in models["stock"].modules())
        raise ModelInputError(
            f"{target}: no attention module became slim, so there is nothing to measure: "
            + (
                "its nn.MultiheadAttention modules were not built through torch.nn while patched (a class alias "
                "bound before patch()?); build them as nn.MultiheadAttention"
                if held
                else "the model holds no nn.MultiheadAttention; give a model that does"
            )
        )
    args = _inputs(list(run.shapes), run.input_fn, run.dtype, device)
    try:
        with torch.no_grad():
            models["stock"].eval()(*args)
    except Exception as error:
        raise ModelInputError(
            f"--input: the model rejected its inputs: {type(error).__name__}: {str(error).strip().splitlines()[0]}; "
            "give the shapes (or --input-fn) its forward takes"
        ) from None
    agreement = _agreement(models, args)
    paths = {name: _census(model, args) for name, model in models.items() if name != "stock"}
    compiled = {}
    if run.compile_backend is not None:
        compiled = {"compile_backend": run.compile_backend, "graph_breaks": _graph_breaks(models, args)}
        models = {name: cast(nn.Module, torch.compile(m, backend=run.compile_backend)) for name, m in models.items()}
    return {
        "model": target,
        "inputs": [list(a.shape) if isinstance(a, Tensor) else type(a).__name__ for a in args],
        "dtype": str(run.dtype).removeprefix("torch."),
        "device": device.type,
        "threads": torch.get_num_threads(),
        "attention_modules": swapped,
        "agrees": agreement["agrees"],
        "errors": agreement["errors"],
        "paths": paths,
        **compiled,
        **_timed(models, args, run.modes, settings, device),
    }


def _graph_breaks(models: dict[str, nn.Module], args: tuple) -> dict[str, dict[str, dict]]:
    """Dynamo's graph breaks in each model's forward, in eval and in train mode."""
    breaks: dict[str, dict[str, dict]] = {}
    for mode in ("inference", "train"):
        breaks[mode] = {}
        for name, model in models.items():
            model.train(mode == "train")
            with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
                breaks[mode][name] = graph_breaks(model, *args)
            model.eval()
    return breaks


def format_model(result: dict) -> str:
    names = list(result["paths"])
    first = next(mode for mode in MODES if mode in result)
    contenders = list(result[first]["ms"])
    lines = [
        f"{result['model']}: {result['attention_modules']} attention module(s) made slim; "
        f"outputs and gradients {'agree' if result['agrees'] else 'DO NOT AGREE'} with stock "
        f"({result['dtype']}, against a float64 run)",
        f"{'':<10} " + " ".join(f"{name + ' ms':>12}" for name in contenders) + "   paired ratios",
    ]
    for mode in (mode for mode in MODES if mode in result):
        timed = result[mode]
        ratios = ", ".join(
            f"{key.replace('_over_', '/')} " + ("stalled" if paired is None else f"{paired['median']:.2f}x")
            for key, paired in timed["paired"].items()
        )
        lines.append(f"{mode:<10} " + " ".join(f"{timed['ms'][name]:>12.2f}" for name in contenders) + f"   {ratios}")
        for kind in ("peak_bytes", "saved_bytes"):
            if kind in timed:
                sizes = ", ".join(f"{name} {_size(count)}" for name, count in timed[kind].items())
                lines.append(f"{'':<10} {'peak' if kind == 'peak_bytes' else 'saved for backward'}: {sizes}")
    for name in names:
        for mode, rows in result["paths"][name].items():
            lines.append(
                f"{name} paths in {mode}: "
                + "; ".join(
                    f"{row['kind']} {row['path']} x{row['calls']}" + (f" ({row['why']})" if row["why"] else "")
                    for row in rows
                )
            )
    lines.append(
        "paired a/b: the median over interleaved repeats of a's time over b's (above 1, b is faster); it can\n"
        "differ from the ratio of the two medians, whose repeats are not paired"
    )
    if "compile_backend" in result:
        lines.append(f"timed under torch.compile(backend={result['compile_backend']!r}); graph breaks:")
        for mode, found_by_name in result["graph_breaks"].items():
            lines.append(f"  {mode}: " + ", ".join(f"{name} {found['count']}" for name, found in found_by_name.items()))
            for name, found in found_by_name.items():
                lines.extend(f"    {name}: {reason}" for reason in found["reasons"][:3])
    return "\n".join(lines)


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subcommand(
        subparsers,
        "model",
        help="your own model: built stock and patched, compared and timed",
        description="Build MODULE:CALLABLE (called with no arguments) stock and under slim_mha.patched(), check\n"
        "that they agree, and time inference and a training step of both (slim_mha/bench/model/command.py).",
        examples=_EXAMPLES,
    )
    parser.add_argument(
        "target", metavar="MODULE:CALLABLE", help="what builds the model, e.g. torchvision.models:vit_b_16"
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="a random float input of this shape, e.g. 2x3x224x224; one per positional argument "
        "(with --input-fn: the shapes it is given)",
    )
    parser.add_argument(
        "--input-fn",
        metavar="MODULE:CALLABLE",
        help="returns the model's arguments (a tuple, or one tensor): token ids, graphs",
    )
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    parser.add_argument("--mode", choices=("both", *MODES), default="both", help="what to time (default: both)")
    parser.add_argument(
        "--skip-unread-weights",
        action="store_true",
        help="also time slim built with skip_unread_weights=True (as slim_skip)",
    )
    add_device_option(parser)
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15 on CPU)", cold=False)
    parser.add_argument(
        "--allocator",
        choices=("warm", "inherited"),
        default="warm",
        help="warm: the C allocator never maps or returns memory (a long-running job's steady state, the\n"
        "default); inherited: glibc as a fresh process has it, which maps each large buffer afresh",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="time both models under torch.compile (default backend: inductor) and count their graph breaks",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.set_defaults(handler=run, parser=parser)
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> int:
    device, settings = device_and_settings(args)
    model_run = ModelRun(
        tuple(args.input),
        args.input_fn,
        _DTYPES[args.dtype],
        MODES if args.mode == "both" else (args.mode,),
        args.skip_unread_weights,
        args.compile,
    )
    # Stock's encoder warns, once, that nested tensors are a prototype: its choice, not a measurement.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    try:
        with allocator_state("warm") if args.allocator == "warm" else contextlib.nullcontext():
            result = benchmark_model(args.target, model_run, settings, device)
    except ModelInputError as error:
        print(f"slim-mha-bench model: {error}", file=sys.stderr)
        return 2
    result["command"] = " ".join(["python -m slim_mha.bench", *argv])
    if args.json:
        write_json(args.json, result)
    print(format_model(result))
    if args.json:
        print(f"results written to {args.json}")
    return 0 if result["agrees"] else 1
