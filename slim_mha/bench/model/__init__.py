"""`python -m slim_mha.bench model MODULE:CALLABLE`: a user's own model, stock against slim."""
