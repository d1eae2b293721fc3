"""The fast engine: static caches, our own forwards of the target and the drafter, CUDA graphs."""
