"""What ``torch.compile`` makes of a call: Dynamo's graph breaks, counted without compiling."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["graph_breaks"]


def graph_breaks(fn: Callable, *args) -> dict:
    """Dynamo's graph breaks in ``fn(*args)``: ``{"count": N, "reasons": [...]}``, the reasons distinct
    and one line each (``torch._dynamo.explain``, which traces the call without compiling it; its
    caches are reset before and after, so the count is this call's and nothing compiled is left)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*args)
    finally:
        torch._dynamo.reset()
    reasons = {str(getattr(reason, "reason", reason)).strip().splitlines()[0] for reason in explained.break_reasons}
    return {"count": explained.graph_break_count, "reasons": sorted(reasons)}
