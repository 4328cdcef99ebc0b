"""`python -m slim_mha.bench encoder`: `nn.TransformerEncoder` in inference, patched against stock."""
