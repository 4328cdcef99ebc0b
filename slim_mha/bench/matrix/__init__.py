"""The quick matrix (`python -m slim_mha.bench run`, the default command): the cases, the contenders
(stock, slim, the floor), running one case, the report and its targets; and the correctness matrix
(`python -m slim_mha.bench.matrix.correctness`)."""
