"""Where a compiled call's time goes, stock against slim: Dynamo's guards, and the compiled graphs.

    python benchmarks/compiled_overhead.py [--repeats 21] [--threads 2] [--shape 2x16x64x4 ...]

Stock and slim self-attention with a key padding mask and stock's default ``need_weights=True``,
each wrapped in ``torch.compile`` (inductor), in inference (eval, ``inference_mode``) and a training
step. Per mode and contender: the guards Dynamo installs for the call (``torch._dynamo.explain``),
then, from ``torch.profiler`` over 300 warm calls, the microseconds per call of Dynamo's cache
lookup (where the guards are evaluated) and of the compiled graphs (forward, and backward in
training), and the whole call's median from the benchmark's interleaved timer.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from _script import parse_script_arguments, script_parser
from torch import nn
from torch.profiler import ProfilerActivity, profile

from slim_mha import SlimMultiheadAttention
from slim_mha.bench.matrix.cases import parse_shape
from slim_mha.bench.matrix.contenders import case_masks
from slim_mha.bench.measure.allocator import allocator_state
from slim_mha.bench.measure.timing import Settings, measure, median_of_ratios

SHAPES = ("2x16x64x4",)
_CALLS = 300


def guards(module: nn.Module, arguments: tuple, keywords: dict, train: bool) -> int:
    """The guards Dynamo installs for ``module(*arguments, **keywords)`` (``torch._dynamo.explain``)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with contextlib.nullcontext() if train else torch.inference_mode():
            return len(torch._dynamo.explain(module)(*arguments, **keywords).out_guards)
    finally:
        torch._dynamo.reset()


def compiled_step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, keywords: dict, train: bool):
    """One call of ``module`` under ``torch.compile``: inference, or forward and backward into ``grad``."""
    compiled = torch.compile(module.train(train))

    def step() -> None:
        if train:
            compiled(x, x, x, **keywords)[0].backward(grad)
            return
        with torch.inference_mode():
            compiled(x, x, x, **keywords)

    return step


def profiled(step) -> dict[str, float]:
    """Microseconds per call of Dynamo's cache lookup and of the compiled graphs, from the profiler."""
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU]) as profiler:
        warnings.simplefilter("ignore")
        for _ in range(_CALLS):
            step()
    parts = {"guards (cache lookup)": 0.0, "compiled graphs": 0.0}
    for event in profiler.key_averages():
        if event.key == "TorchDynamo Cache Lookup":
            parts["guards (cache lookup)"] += event.self_cpu_time_total / _CALLS
        elif event.key.startswith("## Call CompiledFxGraph"):
            parts["compiled graphs"] += event.cpu_time_total / _CALLS
    return parts


def main() -> None:
    args = parse_script_arguments(script_parser(__doc__, SHAPES))
    for text in args.shape or SHAPES:
        batch, length, width, heads = parse_shape(text)
        torch.manual_seed(0)
        stock = nn.MultiheadAttention(width, heads, batch_first=True)
        slim = SlimMultiheadAttention(width, heads, batch_first=True)
        slim.load_state_dict(stock.state_dict())
        masks = case_masks("padding", batch, length, torch.device("cpu"))
        for mode in ("inference", "train"):
            train = mode == "train"
            x = torch.randn(batch, length, width, requires_grad=train)
            grad = torch.randn(batch, length, width)
            modules = {"stock": stock, "slim": slim}
            counts = {name: guards(module.train(train), (x, x, x), masks, train) for name, module in modules.items()}
            steps = {
                name: (compiled_step(module, x, grad, masks, train), lambda: None) for name, module in modules.items()
            }
            with allocator_state("warm"):
                timed = measure(steps, torch.device("cpu"), Settings(repeats=args.repeats))
                parts = {name: profiled(step) for name, (step, _) in steps.items()}
            paired = median_of_ratios(timed["stock"].samples_ms, timed["slim"].samples_ms)
            print(f"B={batch} L={length} E={width} H={heads} {mode}, padding mask, need_weights=True:")
            for name in steps:
                detail = ", ".join(f"{part} {us:.1f} us" for part, us in parts[name].items())
                print(f"  {name:<5} {counts[name]:>4} guards; call {timed[name].median_ms * 1e3:.1f} us; {detail}")
            print(f"  stock/slim, paired: {paired:.3f}x")


if __name__ == "__main__":
    main()
