"""Embeddings of a generative model's requests: the last prompt token's final hidden state.

An embedding request (:mod:`replica.protocol.pooling_params`) is prefilled like any prompt; the
step that computes its last prompt token gives it a logits row (``ModelInputs.pool_rows``, after
the prompt rows). The output layer's input at that row is the decoder's final hidden state after
its final norm (transformers' causal LMs compute ``lm_head(hidden_states[:, logits_to_keep])``
from the base model's ``last_hidden_state``), which :func:`capture_head_input` reads with a forward
pre-hook on the output layer, so the forward itself, compiled or not, is the same as for any step
and the other rows' tokens do not change. :func:`pool` then keeps the first ``dimensions``
components and L2-normalizes: last-token pooling, vLLM's default for decoder LMs used as embedders
(``docs/embeddings.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from replica.protocol.pooling_params import PoolingParams


@contextmanager
def capture_head_input(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While the block runs, record the input of ``model``'s output layer
    (``get_output_embeddings()``) at each call: ``[num_logits_rows, hidden]`` tensors, appended
    to the list this yields. The hook only reads; it is removed on exit."""
    captured: list[torch.Tensor] = []

    def hook(_module, args):
        captured.append(args[0].reshape(-1, args[0].shape[-1]))

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def pool(hidden: torch.Tensor, params: Sequence[PoolingParams], normalize: bool = True) -> list[list[float]]:
    """Each row of ``hidden`` ``[n, hidden_size]`` (any float dtype) as one request's embedding,
    in float32: its first ``params[i].dimensions`` components (all where None), L2-normalized
    where ``params[i].normalize`` and ``normalize`` (the model's own pipeline normalizes:
    ``replica/pooling/config.py``; ``torch.nn.functional.normalize``, eps 1e-12)."""
    rows = hidden.float()
    out = []
    for row, p in zip(rows, params, strict=True):
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if p.normalize and normalize:
            row = torch.nn.functional.normalize(row, dim=-1)
        out.append(row.cpu().tolist())
    return out
