"""`python -m slim_mha.bench detr`: a DETR-style decoder layer, stock against slim with
`skip_unread_weights`."""
