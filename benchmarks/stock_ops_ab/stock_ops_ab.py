"""Does the "stock ops" path still win, now that each call's facts come from one plan?

    python benchmarks/stock_ops_ab/stock_ops_ab.py [wide]

For each configuration, slim as it is (taking "stock ops" where choose_path picks it) against slim
with that path switched off (STOCK_OPS_MAX_SCORE_BYTES emptied: the general path runs), timed in
blocks interleaved in a fresh random order, 11 repeats; printed: the median over repeats of the
general path's time over stock ops'. Above 1.03 the short path earns its keep (3% or more).
"""

import random
import statistics
import sys
import time

import torch

import slim_mha.paths as paths
from slim_mha import SlimMultiheadAttention
from slim_mha._stock_checks import AttentionCall
from slim_mha.paths import choose_path

torch.set_num_threads(2)

ORIG = dict(paths.STOCK_OPS_MAX_SCORE_BYTES)
SMALL = [  # (B, L, E, H, batch_first, mode)
    (2, 16, 64, 4, True, "train"),
    (4, 64, 64, 4, True, "train"),
    (8, 32, 128, 8, True, "train"),
    (2, 16, 64, 4, False, "train"),
    (4, 64, 64, 4, False, "inference"),
    (2, 16, 64, 4, False, "inference"),
    (8, 32, 128, 8, False, "inference"),
    (2, 16, 64, 4, True, "inference"),
]
WIDE = [  # scores of 64K, 128K, 192K and 256K bytes (fp32), up to the path's limit
    (2, 32, 128, 8, True, "train"),
    (4, 32, 128, 8, True, "train"),
    (6, 32, 128, 8, True, "train"),
    (8, 32, 128, 8, True, "train"),
    (4, 64, 64, 4, True, "train"),
    (2, 64, 256, 8, True, "train"),
    (4, 32, 128, 8, False, "train"),
    (8, 32, 128, 8, False, "train"),
]
configs = WIDE if sys.argv[1:] == ["wide"] else SMALL


def run(m, x, mode):
    if mode == "train":
        m(x, x, x)[0].sum().backward()
    else:
        with torch.inference_mode():
            m(x, x, x)


results = []
for B, L, E, H, bf, mode in configs:
    torch.manual_seed(0)
    m = SlimMultiheadAttention(E, H, batch_first=bf).train(mode == "train")
    x = torch.randn(*((B, L, E) if bf else (L, B, E)), requires_grad=(mode == "train"))
    with torch.inference_mode() if mode != "train" else torch.enable_grad():
        path = choose_path(m, AttentionCall(x, x, x, None, True, None, True, False)).path
    n = 200 if L <= 32 else 60
    ratios = []
    for _ in range(11):
        order = ["ops", "general"]
        random.shuffle(order)
        t = {}
        for which in order:
            paths.STOCK_OPS_MAX_SCORE_BYTES.clear()
            if which == "ops":
                paths.STOCK_OPS_MAX_SCORE_BYTES.update(ORIG)
            for _ in range(10):
                run(m, x, mode)
            s = time.perf_counter()
            for _ in range(n):
                run(m, x, mode)
            t[which] = (time.perf_counter() - s) / n
        ratios.append(t["general"] / t["ops"])
    paths.STOCK_OPS_MAX_SCORE_BYTES.clear()
    paths.STOCK_OPS_MAX_SCORE_BYTES.update(ORIG)
    r = statistics.median(ratios)
    results.append((B, L, E, H, bf, mode, path, r))
    print(
        f"B={B} L={L} E={E} H={H} batch_first={bf} {mode}: path with it '{path}', general/stock-ops time {r:.3f}",
        flush=True,
    )
