"""Slim against stock on one device, over the core configuration matrix: ``python tests/device_matrix.py``.

Written for a lent GPU, where the unit tests do not run (``benchmarks/cuda_run.sh`` calls it); it runs
on CPU too, and ``tests/test_device_matrix.py`` runs it there. Each
configuration builds stock with every parameter random (so the key bias is non-zero), loads slim
from it, and runs both on the same inputs, plus stock in float64 on the same (rounded) weights as
the reference. It compares the output, the attention weights and, in training, the gradients of the
inputs and of every parameter slim keeps.

A configuration passes when slim is as close to the float64 reference as stock is:
``error(slim) <= 2 * error(stock) + FLOOR[dtype]``, errors being ``max|x - ref| / max(1, max|ref|)``.
Comparing both with a higher-precision reference, rather than slim with stock, does not fail a
configuration because the two round differently in half precision.

The matrix: every attention kind × appended tokens × weights option × mode × dtype, with
``batch_first`` alternating, and a seeded random sweep over masks, causal hints and unbatched inputs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from slim_mha._matrix import (
    APPENDED,
    ATTENTION_KINDS,
    MODES,
    TOLERANCE,
    WEIGHTS,
    appended_options,
)
from slim_mha.attention import SlimMultiheadAttention

__all__ = ["Config", "check_config", "core_matrix", "main"]

EMBED, HEADS, KDIM, VDIM, TARGET, SOURCE, BATCH = 64, 4, 40, 48, 33, 47, 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The project's one matrix and slim-vs-stock tolerance table (slim_mha/_matrix.py), as the tests use.
FLOOR = {name: TOLERANCE[dtype] for name, dtype in DTYPES.items()}
KINDS = ATTENTION_KINDS
MASKS = ("none", "bool", "float")
ATTN_MASKS = ("none", "2d", "3d", "causal")


@dataclass(frozen=True)
class Config:
    kind: str = "self"
    appended: str = "none"
    weights: str = "averaged"
    mode: str = "train"
    dtype: str = "fp32"
    batch_first: bool = True
    batched: bool = True
    key_padding_mask: str = "none"
    attn_mask: str = "none"
    seed: int = 0

    def module_kwargs(self) -> dict:
        kwargs: dict[str, object] = dict(**appended_options(self.appended), batch_first=self.batch_first)
        if self.kind == "kdim_vdim":
            kwargs.update(kdim=KDIM, vdim=VDIM)
        return kwargs


def core_matrix(dtypes: list[str], *, sweep: int = 200, seed: int = 0) -> list[Config]:
    """The structured product over the core axes, then ``sweep`` random configurations with masks."""
    configs = [
        Config(kind, appended, weights, mode, dtype, batch_first=index % 2 == 0)
        for index, (dtype, kind, appended, weights, mode) in enumerate(
            itertools.product(dtypes, KINDS, APPENDED, WEIGHTS, MODES)
        )
    ]
    draw = random.Random(seed)
    for index in range(sweep):
        configs.append(
            Config(
                kind=draw.choice(KINDS),
                appended=draw.choice(APPENDED),
                weights=draw.choice(WEIGHTS),
                mode=draw.choice(MODES),
                dtype=draw.choice(dtypes),
                batch_first=draw.random() < 0.5,
                batched=draw.random() < 0.8,
                key_padding_mask=draw.choice(MASKS),
                attn_mask=draw.choice(ATTN_MASKS),
                seed=index + 1,
            )
        )
    return configs


def _modules(config: Config, device: torch.device) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Stock (random parameters), slim loaded from it, and stock in float64 on the same rounded weights."""
    dtype = DTYPES[config.dtype]
    torch.manual_seed(config.seed)
    stock = nn.MultiheadAttention(EMBED, HEADS, **config.module_kwargs())
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    stock = stock.to(device=device, dtype=dtype)
    slim = SlimMultiheadAttention(EMBED, HEADS, **config.module_kwargs(), device=device, dtype=dtype)
    slim.load_state_dict(stock.state_dict())
    reference = nn.MultiheadAttention(EMBED, HEADS, **config.module_kwargs(), device=device, dtype=torch.float64)
    reference.load_state_dict(stock.state_dict())
    training = config.mode == "train"
    return stock.train(training), slim.train(training), reference.train(training)


def _inputs(config: Config, device: torch.device, dtype: torch.dtype) -> dict:
    """Inputs in the module's layout; masks never mask a whole row (key 0 stays visible)."""
    generator = torch.Generator().manual_seed(config.seed + 1)

    def tokens(length: int, width: int) -> Tensor:
        shape: tuple[int, ...] = (length, width)
        if config.batched:
            shape = (BATCH, length, width) if config.batch_first else (length, BATCH, width)
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)

    query = tokens(TARGET, EMBED)
    source = TARGET if config.kind == "self" else SOURCE
    if config.kind == "self":
        key = value = query
    elif config.kind == "cross_shared_kv":
        key = value = tokens(SOURCE, EMBED)
    elif config.kind == "cross":
        key, value = tokens(SOURCE, EMBED), tokens(SOURCE, EMBED)
    else:
        key, value = tokens(SOURCE, KDIM), tokens(SOURCE, VDIM)
    inputs = dict(
        query=query,
        key=key,
        value=value,
        need_weights=config.weights != "none",
        average_attn_weights=config.weights == "averaged",
    )

    def as_mask(blocked: Tensor, kind: str) -> Tensor:
        blocked = blocked.to(device)
        if kind == "bool":
            return blocked
        return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill(blocked, float("-inf"))

    mask_kind = config.key_padding_mask if config.key_padding_mask != "none" else "float"
    if config.key_padding_mask != "none":
        padded = torch.rand(*((BATCH,) if config.batched else ()), source, generator=generator) < 0.4
        padded[..., 0] = False
        inputs["key_padding_mask"] = as_mask(padded, mask_kind)
    if config.attn_mask == "causal":
        inputs["attn_mask"] = as_mask(torch.ones(TARGET, source, dtype=torch.bool).triu(1), mask_kind)
        inputs["is_causal"] = True
    elif config.attn_mask != "none":
        leading = ((BATCH if config.batched else 1) * HEADS,) if config.attn_mask == "3d" else ()
        blocked = torch.rand(*leading, TARGET, source, generator=generator) < 0.3
        blocked[..., 0] = False
        inputs["attn_mask"] = as_mask(blocked, mask_kind)
    return inputs


def _as(inputs: dict, dtype: torch.dtype, requires_grad: bool) -> dict:
    """A copy of ``inputs`` in ``dtype`` (float masks too), keeping which of q/k/v are the same tensor."""
    converted: dict = {}
    for name, value in inputs.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            earlier = [other for other in ("query", "key") if other in converted and inputs[other] is value]
            if earlier:
                converted[name] = converted[earlier[0]]
                continue
            value = value.detach().to(dtype)
            if name in ("query", "key", "value"):
                value.requires_grad_(requires_grad)
        converted[name] = value
    return converted


def _run(module: nn.Module, inputs: dict, config: Config, cotangent: dict | None) -> dict:
    """Output, weights and (in training) gradients by name, for one module."""
    if config.mode in ("no_grad", "inference_mode"):
        with torch.no_grad() if config.mode == "no_grad" else torch.inference_mode():
            out, weights = module(**inputs)
    else:
        out, weights = module(**inputs)
    results = {"output": out, "weights": weights}
    if config.mode != "train":
        return results
    if cotangent is None:  # a training check backpropagates these
        raise ValueError(f"{config}: a training check needs its cotangents")
    loss = (out * cotangent["output"].to(out.dtype)).sum()
    if weights is not None:
        loss = loss + (weights * cotangent["weights"].to(weights.dtype)).sum()
    loss.backward()
    for name in ("query", "key", "value"):
        if inputs[name].grad is not None:
            results[f"grad {name}"] = inputs[name].grad
    # Slim's parameters are stock's, by name: the key slot's gradient is exactly zero on slim and
    # rounding noise around zero on stock and the reference.
    results.update((f"grad {name}", parameter.grad) for name, parameter in module.named_parameters())
    return results


def _scaled_error(actual: Tensor, expected: Tensor) -> float:
    expected = expected.detach().double()
    if expected.numel() == 0:
        return 0.0
    scale = max(1.0, expected.abs().max().item())
    return (actual.detach().double() - expected).abs().max().item() / scale


def check_config(config: Config, device: torch.device) -> dict:
    """Errors of stock and slim against the float64 reference, per compared tensor, and the verdict."""
    stock, slim, reference = _modules(config, device)
    dtype = DTYPES[config.dtype]
    base = _inputs(config, device, torch.float64)
    training = config.mode == "train"
    generator = torch.Generator().manual_seed(config.seed + 2)
    cotangent = None
    if training:
        probe = _run(reference, _as(base, torch.float64, False), replace(config, mode="eval"), None)
        cotangent = {
            name: torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(device)
            for name, tensor in probe.items()
            if tensor is not None
        }
    expected = _run(reference, _as(base, torch.float64, training), config, cotangent)
    stock_results = _run(stock, _as(base, dtype, training), config, cotangent)
    slim_results = _run(slim, _as(base, dtype, training), config, cotangent)

    compared, failures = {}, []
    keys = [name for name in expected if name in slim_results or name in stock_results]
    if set(slim_results) - set(expected):
        failures.append(f"slim returned unexpected {sorted(set(slim_results) - set(expected))}")
    for name in keys:
        want, got_stock, got_slim = expected[name], stock_results.get(name), slim_results.get(name)
        if want is None or got_slim is None:
            if (want is None) != (got_slim is None):
                failures.append(f"{name}: present in one of reference/slim only")
            continue
        if got_slim.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got_slim.shape)} != {tuple(want.shape)}")
            continue
        slim_error = _scaled_error(got_slim, want)
        stock_error = _scaled_error(got_stock, want) if got_stock is not None else 0.0
        allowed = 2 * stock_error + FLOOR[config.dtype]
        compared[name] = {"slim": slim_error, "stock": stock_error, "allowed": allowed}
        if not slim_error <= allowed:  # NaN fails
            failures.append(f"{name}: slim error {slim_error:.2e} > allowed {allowed:.2e} (stock {stock_error:.2e})")
    return {"config": asdict(config), "passed": not failures, "failures": failures, "errors": compared}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tests/device_matrix.py",
        description="Compare slim with stock on one device over the core configuration matrix.",
        epilog=(
            "examples:\n"
            "  python tests/device_matrix.py --device cuda --dtype fp32,bf16 --json out/correctness.json\n"
            "  python tests/device_matrix.py --device cpu --sweep 20"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16 (default: fp32,bf16)")
    parser.add_argument("--sweep", type=int, default=200, help="random configurations with masks (default: 200)")
    parser.add_argument("--limit", type=int, help="check only the first N configurations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every configuration's errors here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch; use --device cpu")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    dtypes = [name for name in args.dtype.split(",") if name]
    unknown = [name for name in dtypes if name not in DTYPES]
    if unknown:
        parser.error(f"--dtype: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    if args.sweep < 0:
        parser.error(f"--sweep must be at least 0, got {args.sweep}")

    configs = core_matrix(dtypes, sweep=args.sweep, seed=args.seed)[: args.limit]
    started = time.perf_counter()
    results = []
    for config in configs:
        try:
            results.append(check_config(config, device))
        except Exception as error:  # a crash is a failure of this configuration, not of the run
            results.append({"config": asdict(config), "passed": False, "failures": [f"raised {error!r}"], "errors": {}})
    failed = [result for result in results if not result["passed"]]
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for result in results:
        for name, measured in result["errors"].items():
            key = (result["config"]["dtype"], name)
            worst[key] = max(worst.get(key, (0.0, 0.0)), (measured["slim"], measured["stock"]))
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "configurations": len(results),
        "failed": len(failed),
        "seconds": time.perf_counter() - started,
    }
    print(
        f"slim vs stock on {summary['device']} (torch {summary['torch']}): "
        f"{len(results) - len(failed)}/{len(results)} configurations pass ({summary['seconds']:.0f} s)"
    )
    print("largest error against the float64 reference (slim / stock), per dtype and tensor:")
    for (dtype, name), (slim_error, stock_error) in sorted(worst.items()):
        print(f"  {dtype:<5} {name:<20} {slim_error:.2e} / {stock_error:.2e}")
    for result in failed[:20]:
        print(f"FAIL {result['config']}: {'; '.join(result['failures'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
