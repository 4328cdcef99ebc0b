"""Factories for ``python -m slim_mha.bench model`` on the client libraries recorded in RESULTS.md.

The command calls a factory with no arguments, so models that take options are built here: open_clip's
ViT-B-32 without pretrained weights (nothing is downloaded), and a batch of its inputs. Run from the
repository root with ``PYTHONPATH=benchmarks``; torchvision and open_clip are not dependencies of
slim_mha: install them to run these.
"""

from __future__ import annotations

import torch


def open_clip_vit_b_32():
    import open_clip

    return open_clip.create_model("ViT-B-32", pretrained=None)


def open_clip_batch() -> tuple:
    """Two images and two token sequences of CLIP's context length (77), made up, seeded."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 224, 224, generator=generator)
    tokens = torch.randint(1, 49407, (2, 77), generator=generator)
    return images, tokens
