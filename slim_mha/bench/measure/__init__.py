"""The shared measuring code of every benchmark command: timing, memory, the allocator, the
competing load, the options they share, the environment a result records, and writing results."""
