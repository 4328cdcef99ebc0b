"""``python -m slim_mha.bench encoder``: ``nn.TransformerEncoder`` in inference, patched against stock.

Stock's encoder layer runs a fused kernel in inference (``torch._transformer_encoder_layer_fwd``);
under ``slim_mha.patched()`` the layer hands the calls where slim wins to slim's attention and keeps
stock's kernel where it does not (``slim_mha.encoder_layer.layer_path``). Each case builds stock's
encoder and the patched one from the same weights, checks that their outputs agree, and times both
interleaved, under ``torch.inference_mode``, with the peak memory of one call of each. The padding
mask pads the last quarter of every other sequence, left-aligned, so stock's default
``enable_nested_tensor=True`` turns the batch into a nested tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..measure.allocator import allocator_state
from ..measure.memory import profile_step
from ..measure.options import (
    add_device_option,
    add_timing_options,
    device_and_settings,
    subcommand,
)
from ..measure.output import write_json
from ..measure.timing import Settings, measure, median_of_ratios

__all__ = ["EncoderCase", "add_parser", "encoder_cases", "run", "run_encoder_case"]

_EXAMPLES = """\
examples:
  python -m slim_mha.bench encoder
  python -m slim_mha.bench encoder --length 128 --length 512 --repeats 21 --json out/encoder.json
"""


@dataclass(frozen=True)
class EncoderCase:
    length: int
    padding: bool
    nested: bool = True  # nn.TransformerEncoder's enable_nested_tensor
    batch: int = 4
    embed_dim: int = 256
    heads: int = 8
    feedforward: int = 1024
    layers: int = 2

    @property
    def label(self) -> str:
        mask = "padding" if self.padding else "no mask"
        nested = "" if self.nested or not self.padding else ", enable_nested_tensor=False"
        return f"B={self.batch} L={self.length} E={self.embed_dim} H={self.heads}, {self.layers} layers, {mask}{nested}"


def encoder_cases(lengths: list[int]) -> list[EncoderCase]:
    cases = []
    for length in lengths:
        cases += [EncoderCase(length, False), EncoderCase(length, True), EncoderCase(length, True, nested=False)]
    return cases


def _build(case: EncoderCase, device: torch.device, patched: bool) -> nn.Module:
    import slim_mha  # the package's own entry point, as a user calls it

    def encoder() -> nn.Module:
        layer = nn.TransformerEncoderLayer(case.embed_dim, case.heads, case.feedforward, batch_first=True)
        return nn.TransformerEncoder(layer, case.layers, enable_nested_tensor=case.nested)

    torch.manual_seed(0)
    if not patched:
        return encoder().to(device).eval()
    with slim_mha.patched():
        return encoder().to(device).eval()


def run_encoder_case(case: EncoderCase, settings: Settings, device: torch.device) -> dict:
    stock = _build(case, device, patched=False)
    slim = _build(case, device, patched=True)
    slim.load_state_dict(stock.state_dict())
    generator = torch.Generator().manual_seed(settings.seed)
    x = torch.randn(case.batch, case.length, case.embed_dim, generator=generator).to(device)
    padding = None
    if case.padding:
        padding = torch.zeros(case.batch, case.length, dtype=torch.bool, device=device)
        padding[1::2, case.length - case.length // 4 :] = True
    calls = {
        name: (lambda module=module: module(x, src_key_padding_mask=padding))
        for name, module in (("stock", stock), ("slim", slim))
    }
    with torch.inference_mode():
        error = (calls["slim"]() - calls["stock"]()).abs().max().item()
        peaks = {name: profile_step(call, device).peak_bytes for name, call in calls.items()}
        summaries = measure({name: (call, lambda: None) for name, call in calls.items()}, device, settings)
    paired = median_of_ratios(summaries["stock"].samples_ms, summaries["slim"].samples_ms)
    stalled = sorted(name for name, summary in summaries.items() if summary.stalled)
    return {
        "stalled": stalled,  # timing.py: stalls even when measured again; no ratio is printed then
        "case": asdict(case),
        "label": case.label,
        "slim_path": "stock's fused layer" if _takes_stock(slim, x, padding) else "slim's attention",
        "stock_over_slim": paired,
        "stock_ms": summaries["stock"].median_ms,
        "slim_ms": summaries["slim"].median_ms,
        "peak_bytes": peaks,
        "max_abs_error": error,
    }


def _takes_stock(encoder: nn.Module, x: torch.Tensor, padding) -> bool:
    from slim_mha.encoder_layer import layer_path

    with torch.inference_mode():
        if padding is not None and encoder.use_nested_tensor:  # what stock's encoder gives its layers
            x, padding = torch._nested_tensor_from_mask(x, padding.logical_not(), mask_check=False), None
        first = cast(nn.TransformerEncoderLayer, cast(nn.ModuleList, encoder.layers)[0])
        return layer_path(first, x, None, padding)[0] != "slim layer"


def format_encoder(results: list[dict]) -> str:
    lines = [
        "| case | slim's layer runs | stock ms | slim ms | stock/slim (paired) | peak stock | peak slim | max error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peaks = r["peak_bytes"]
        ratio = "stalled" if r.get("stalled") else f"{r['stock_over_slim']:.2f}x"
        lines.append(
            f"| {r['label']} | {r['slim_path']} | {r['stock_ms']:.2f} | {r['slim_ms']:.2f} | {ratio} "
            f"| {peaks['stock'] / 2**20:.1f} MiB | {peaks['slim'] / 2**20:.1f} MiB | {r['max_abs_error']:.1e} |"
        )
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subcommand(
        subparsers,
        "encoder",
        help="nn.TransformerEncoder in inference: patched against stock's fused layer",
        description="Time nn.TransformerEncoder (2 layers, B=4 E=256 H=8, feed-forward 1024) in inference,\n"
        "stock against slim_mha.patched(), with and without a padding mask (slim_mha/bench/encoder/command.py).",
        examples=_EXAMPLES,
    )
    add_device_option(parser)
    add_timing_options(parser, repeats_help="timed repeats per contender (default: 15 on CPU)", cold=False)
    parser.add_argument("--length", type=int, action="append", help="sequence lengths (default: 128, 512, 2048)")
    parser.add_argument(
        "--allocator",
        choices=("warm", "inherited"),
        default="warm",
        help="warm: the C allocator never maps or returns memory (a long-running job's steady state, the\n"
        "default); inherited: glibc as a fresh process has it, which maps each large buffer afresh",
    )
    parser.add_argument("--json", type=Path, help="results file (default: bench-out/encoder_<device>.json)")
    parser.set_defaults(handler=run, parser=parser)
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> int:
    device, settings = device_and_settings(args)
    lengths = args.length or [128, 512, 2048]
    if any(length < 4 for length in lengths):
        args.parser.error("--length: each length must be at least 4 (a quarter of it is padded)")
    cases = encoder_cases(lengths)
    print(f"expected time: at most about {len(cases) * (settings.max_case_s + 5) / 60:.0f} minutes", flush=True)
    results = []
    # Stock's encoder warns, once, that nested tensors are a prototype: its choice, not a measurement.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    with allocator_state("warm") if args.allocator == "warm" else contextlib.nullcontext():
        for case in cases:
            results.append(run_encoder_case(case, settings, device))
            last = results[-1]
            print(
                f"  {case.label}: "
                + ("stalled, even measured again: no ratio" if last["stalled"] else f"{last['stock_over_slim']:.2f}x"),
                flush=True,
            )
    json_path = args.json or Path("bench-out") / f"encoder_{device.type}.json"
    write_json(
        json_path,
        {
            "command": " ".join(["python -m slim_mha.bench", *argv]),
            "device": device.type,
            "threads": torch.get_num_threads(),
            "allocator": args.allocator,
            "results": results,
        },
    )
    print(format_encoder(results))
    print(f"results written to {json_path}")
    return 0
