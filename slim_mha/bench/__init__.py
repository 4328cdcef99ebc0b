"""The slim_mha benchmark: ``python -m slim_mha.bench`` (or ``slim-mha-bench``).

Modules: ``cases`` (the matrix), ``contenders`` (stock, slim and the floor on shared weights),
``timing`` (interleaved repeats), ``memory`` (saved, peak, parameter and optimizer bytes),
``runner`` (one case), ``report`` (table, targets, JSON, plot), ``correctness`` (slim against
stock over the core configuration matrix, for a GPU run).
"""
