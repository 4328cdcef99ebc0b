"""`python -m slim_mha.bench scale`: cost against the number of tokens, each case in a process of
its own so that one that runs out of memory ends only itself."""
