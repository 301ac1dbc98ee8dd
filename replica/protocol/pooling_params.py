"""A request's pooling parameters: an embedding request instead of a generation one (vLLM's
``PoolingParams``: names and checks).

An embedding request is a prefill-only engine request (its ``SamplingParams`` has ``max_tokens``
0: :func:`embedding_sampling_params`) that carries a :class:`PoolingParams`: when its last prompt
token is computed, the engine returns the pooled hidden state (``EngineOutput.embedding``)
instead of sampling, and the request ends (``docs/embeddings.md``). Torch-free: the ingress builds
these, the replica checks them against its model (:func:`check_dimensions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from replica.protocol.errors import RequestError
from replica.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class PoolingParams:
    """How an embedding request's vector is made (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the first ``dimensions`` components (Matryoshka models only, before the
            normalization), or None for the model's whole hidden size.
        normalize: L2-normalize the pooled vector (vLLM's default for decoder LMs used as
            embedders); on the pooling engine only where the model's own pipeline normalizes too
            (a sentence-transformers ``Normalize`` module: ``replica/pooling/config.py``).
    """

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise RequestError(f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions")


def embedding_sampling_params() -> SamplingParams:
    """The sampling parameters of an embedding request: nothing is generated (``max_tokens`` 0,
    so the prefill ends the request and a prompt of ``max_model_len`` tokens fits)."""
    return SamplingParams(max_tokens=0, temperature=0.0)


def check_dimensions(params: PoolingParams, hidden_size: int, matryoshka: Sequence[int] | bool | None) -> None:
    """``params.dimensions`` is one this model can give: the model is a Matryoshka model
    (``matryoshka``: its config's ``matryoshka_dimensions`` list, or True for ``is_matryoshka``;
    None or False: not one) and ``dimensions`` is one of its listed sizes, or at most
    ``hidden_size`` where it lists none. vLLM's rule and message.

    Raises:
        RequestError: naming ``dimensions``.
    """
    if params.dimensions is None:
        return
    if not matryoshka:
        raise RequestError(
            "dimensions: this model does not support matryoshka representation, changing output dimensions "
            "will lead to poor results", "dimensions",
        )
    if isinstance(matryoshka, bool):
        if params.dimensions > hidden_size:
            raise RequestError(f"dimensions must be at most the model's {hidden_size}, got {params.dimensions}", "dimensions")
    elif params.dimensions not in matryoshka:
        raise RequestError(
            f"dimensions: this model only supports {sorted(matryoshka)} for matryoshka representation, "
            f"got {params.dimensions}", "dimensions",
        )


def matryoshka_of(config) -> list[int] | bool | None:
    """A transformers config's Matryoshka sizes (vLLM reads the same two fields): its
    ``matryoshka_dimensions`` list, else True for ``is_matryoshka``, else None."""
    sizes = getattr(config, "matryoshka_dimensions", None)
    if sizes:
        return list(sizes)
    return True if getattr(config, "is_matryoshka", False) else None
