"""The path each quick-matrix case takes on CUDA (fake tensors, no GPU needed) beside the CPU's:

    python benchmarks/cuda_paths.py > benchmarks/cuda_paths.md

Needs a CUDA build of torch (a CPU-only build cannot run CUDA ops, even on fake tensors). The CUDA
column is what ``slim_mha.paths.choose_path`` decides for real CUDA tensors of each case
(``as_real=True`` on fake ones); the CPU column is its decision on real CPU tensors here.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import slim_mha
from slim_mha._stock_checks import AttentionCall
from slim_mha.bench.matrix.cases import TARGET_SHAPES
from slim_mha.paths import choose_path

MODES = {"inference": (False, torch.inference_mode), "train": (True, torch.enable_grad)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def path_of(shape: tuple[int, int, int, int], dtype: torch.dtype, mode: str, need_weights: bool, cuda: bool) -> str:
    batch, length, width, heads = shape
    training, context = MODES[mode]
    fake = FakeTensorMode(allow_non_fake_inputs=True) if cuda else None
    slim = slim_mha.SlimMultiheadAttention(width, heads, batch_first=True, device="meta", dtype=dtype)
    if fake is not None:
        with fake:
            slim.to_empty(device="cuda")
            x = torch.empty(batch, length, width, device="cuda", dtype=dtype, requires_grad=training)
    else:
        slim.to_empty(device="cpu")
        x = torch.empty(batch, length, width, dtype=dtype, requires_grad=training)
    slim.train(training)
    with context():
        path, why = choose_path(slim, AttentionCall(x, x, x, None, need_weights, None, True, False), as_real=cuda)
    return path + (f" ({why})" if why else "")


def main() -> None:
    print(f"torch {torch.__version__}; quick-matrix shapes, self-attention, batch-first, dropout 0\n")
    print("| B L E H | dtype | mode | weights | CUDA | CPU |")
    print("|---|---|---|---|---|---|")
    for shape in TARGET_SHAPES:
        for dtype_name, dtype in DTYPES.items():
            for mode in MODES:
                for need_weights in (False, True):
                    cuda = path_of(shape, dtype, mode, need_weights, cuda=True)
                    cpu = path_of(shape, dtype, mode, need_weights, cuda=False)
                    label = " ".join(map(str, shape))
                    print(f"| {label} | {dtype_name} | {mode} | {need_weights} | {cuda} | {cpu} |")


if __name__ == "__main__":
    main()
