"""Triton kernels, each with the PyTorch reference it replaces where it was timed faster."""
