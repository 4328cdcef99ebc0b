"""The slim_mha benchmark: ``python -m slim_mha.bench`` (or ``slim-mha-bench``).

Subcommands, one module each, wired by ``__main__``: ``run_command`` (the matrix; the default),
``scale_command`` (time and memory against the number of tokens), ``detr_command`` (DETR's decoder
layer), ``weights_command`` (inference with averaged weights: stock, slim, the floor). Shared by
them: ``options`` (device and timing options), ``cases`` (the matrix), ``contenders`` (stock, slim
and the floor on shared weights), ``allocator`` (the C allocator's warm and cold states, page faults), ``timing``
(interleaved repeats), ``memory`` (saved, peak, parameter and optimizer bytes), ``runner`` (one
case), ``report`` (table, targets, JSON, plot), ``load`` (busy processes), ``detr`` (the DETR
layer). The scale sweep: ``scale_cases``, ``scale_child`` (one case's process), ``scale_memory``,
``scale_sweep``, ``scale_report``, ``scale_plot``. ``correctness``: slim against stock over the
core configuration matrix, for a GPU run.
"""
