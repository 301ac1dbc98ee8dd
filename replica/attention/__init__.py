"""Paged attention: the op transformers models call, the backend interface, one file per backend."""
