"""The quick matrix (``python -m slim_mha.bench [run]``): cases, contenders (stock, slim, the floor),
running one case, the report and its targets."""
