"""`python -m slim_mha.bench weights`: calls that return their attention weights."""
