"""The slim_mha benchmark: ``python -m slim_mha.bench`` (or ``slim-mha-bench``).

One subpackage per command, each with its ``command`` module, wired by ``__main__``:

* ``matrix``: the quick matrix (``run``, the default): cases, contenders (stock, slim, the floor on
  shared weights), one case's run, the report and its targets; and ``matrix.correctness``, slim
  against stock over the core configuration matrix, for a GPU run;
* ``scale``: time and memory against the number of tokens, a process per case;
* ``detr``: DETR's decoder layer with ``skip_unread_weights``;
* ``weights``: calls that return their attention weights;
* ``encoder``: ``nn.TransformerEncoder`` in inference, patched against stock;
* ``model``: a user's own model, stock against slim.

``measure`` holds what they all share: timing (interleaved repeats, stalls), memory (peak, saved,
parameter and optimizer bytes), the allocator's warm and cold states, the busy processes, the
options, the environment a result records, and writing results.
"""
