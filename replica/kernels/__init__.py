"""Carpool's C++ CPU kernels (``csrc/``), their builder and loader, and the step shapes they are padded to."""
