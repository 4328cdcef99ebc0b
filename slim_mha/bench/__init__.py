"""The slim_mha benchmark: ``python -m slim_mha.bench`` (or ``slim-mha-bench``).

One subpackage per command, each with its ``command`` module, wired by ``__main__``:

* ``matrix``: the quick matrix (``run``, the default): cases (shapes, modes, masks, weights),
  contenders (stock, slim, the floor on shared weights, and slim on its other paths), one case's
  run, the report and its targets;
* ``scale``: time and memory against the number of tokens, a process per case;
* ``model``: a model built stock and patched, compared and timed; ``models.py`` holds the ones this
  project records (DETR's decoder layer, ``nn.TransformerEncoder``) as factories for it.

``measure`` holds what they all share: timing (interleaved repeats, stalls), memory (peak, saved,
parameter and optimizer bytes), the allocator's warm and cold states, the busy processes, the
options, the environment a result records, and writing results.
"""
