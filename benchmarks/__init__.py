"""Host-side benchmarks (allocator replay against vLLM 0.32). Not installed with the package."""
