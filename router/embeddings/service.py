"""``POST /v1/embeddings`` from a checked body to OpenAI's response: caps, tokenization, the fan-out
plan and the response body.

Each input is one replica request (a batch of 64 inputs is 64 engine requests, run concurrently
through :meth:`~router.dispatch.fanout.Fanout.run_all`, as a completion's prompts are), in waves
of at most what the running replicas hold (each ``max_num_seqs`` + ``max_waiting_requests``), one
wave after the other, so that a request of up to OpenAI's 2048 inputs never asks for more seats
than the deployment has (:func:`waves`): a
prefill-only request (``SamplingParams`` with ``max_tokens`` 0) carrying
:class:`~replica.protocol.pooling_params.PoolingParams`, whose finished output holds the pooled
vector (``EngineOutput.embedding``). Text inputs are tokenized here, once, with the model's special
tokens (as completions' prompts); token id inputs go as they are. The rules are the engine's own
(:mod:`replica.protocol.request_checks`: ids inside the vocabulary, an input of at most
``max_model_len`` tokens); ``dimensions`` is checked by the replica, which knows whether its model
is a Matryoshka model. The response is OpenAI's: ``{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``, each
embedding a list of floats or (``encoding_format: base64``) its little-endian float32 bytes in
base64, in the inputs' order.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import base64
import dataclasses
import struct
import uuid
from typing import Any

from replica.protocol.envelope import RequestEnvelope
from replica.protocol.errors import RequestError
from replica.protocol.lora_request import LoRARequest
from replica.protocol.outputs import EngineOutput
from replica.protocol.pooling_params import PoolingParams, check_dimensions, embedding_sampling_params
from replica.protocol.request_checks import check_priority, check_prompt_fits, check_token_ids
from replica.protocol.sampling_params import SamplingParams
from router.config import IngressConfig
from router.embeddings.protocol import EmbeddingRequest
from router.request.errors import request_error
from router.request.preparation import Prepared
from router.request.protocol import OpenAIError


class EmbeddingJobs(Prepared):
    """A prepared embedding request: one prompt per input, each run once (``n`` 1) with the
    request's :class:`PoolingParams` in its envelope. Ids: ``embd-<hex>``, input ``i`` as
    ``embd-<hex>-<i>``."""

    def __init__(self, request_id: str, model: str, prompts: list[list[int]], pooling_params: PoolingParams,
                 block_size: int) -> None:
        params = embedding_sampling_params()
        super().__init__(request_id, model, prompts, [""] * len(prompts), [[params] for _ in prompts], block_size)
        self.pooling_params = pooling_params

    def envelope(self, index: int, prompt_index: int, params: SamplingParams) -> RequestEnvelope:
        """As :meth:`Prepared.envelope <router.request.preparation.Prepared.envelope>`, with the pooling parameters."""
        return dataclasses.replace(super().envelope(index, prompt_index, params), pooling_params=self.pooling_params)


def encode_base64(vector: list[float]) -> str:
    """OpenAI's ``base64`` encoding of a vector: its float32 values, little-endian, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


# Characters some tokenizers drop rather than encode (BERT's WordPiece: whitespace, control and
# format characters, accents' combining marks).
_DROPPABLE = (" ", "\t", "\n", "\x00", "\u200b", "\ufeff", "\u0301")


def max_token_chars(tokenizer: Any, probe_len: int = 64) -> int | None:
    """The most characters one token of ``tokenizer`` stands for (its vocabulary's longest entry),
    so that a text of more than ``max_model_len`` × that many characters is refused untokenized;
    None where that bound does not hold: the tokenizer drops some characters (a run of
    ``probe_len`` of one of :data:`_DROPPABLE` gives too few tokens: BERT's gives none for spaces),
    so that a long text may still be a few tokens, and only tokenizing it tells."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    for ch in _DROPPABLE:
        if len(tokenizer.encode(ch * probe_len, add_special_tokens=False)) * longest < probe_len:
            return None
    return longest


def waves(jobs: EmbeddingJobs, size: int) -> list[EmbeddingJobs]:
    """``jobs`` cut into consecutive requests of at most ``size`` inputs (one if it is no larger),
    ids ``<request_id>-w<k>``, each with ``jobs``' adapter and priority; their outputs, in order,
    are ``jobs``' outputs."""
    if len(jobs.prompts) <= size:
        return [jobs]
    out = []
    for k, start in enumerate(range(0, len(jobs.prompts), size)):
        wave = EmbeddingJobs(f"{jobs.request_id}-w{k}", jobs.model, jobs.prompts[start:start + size], jobs.pooling_params,
                             jobs.block_size)
        wave.lora_request, wave.priority = jobs.lora_request, jobs.priority
        out.append(wave)
    return out


class Embeddings:
    """The ``/v1/embeddings`` work of the ingress (see the module docstring).

    Args:
        config: the ingress settings.
        tokenizer: the served model's tokenizer.
        model_name: the served model's name (the response's ``model`` for the base model).
    """

    def __init__(self, config: IngressConfig, tokenizer: Any, model_name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._max_token_chars = max_token_chars(tokenizer)

    async def run(self, jobs: EmbeddingJobs, run_all: Any, wave_size: int) -> list[EngineOutput]:
        """Every input's output, in order: ``run_all(wave)`` (the fan-out's) for each of
        :func:`waves` of ``wave_size`` inputs, one after the other."""
        outputs: list[EngineOutput] = []
        for wave in waves(jobs, max(1, wave_size)):
            outputs += await run_all(wave)
        return outputs

    async def prepare(self, body: EmbeddingRequest, info: dict[str, Any], lora_request: LoRARequest | None) -> EmbeddingJobs:
        """Tokenize the text inputs (in a worker thread) and check every input against the
        replicas' ``model_info`` (``vocab_size``, ``max_model_len``, ``block_size``).

        Raises:
            OpenAIError: 400 naming ``input`` (or ``input.<i>``): a token id outside the
                vocabulary, an input longer than ``max_model_len`` tokens, a text the tokenizer
                refuses; naming ``priority``: not 0 unless the replicas' ``scheduling_policy`` is
                ``"priority"`` (:func:`~replica.protocol.request_checks.check_priority`); naming
                ``dimensions``: one the model cannot give (``info["embedding_size"]``).
        """
        pooling = PoolingParams(dimensions=body.dimensions)
        try:
            priority = check_priority(body.priority, info.get("scheduling_policy", "fcfs"))
            if "embedding_size" in info:  # the replica checks it again; here it costs no replica request
                check_dimensions(pooling, *info["embedding_size"])
        except RequestError as exc:
            raise request_error(exc) from None
        prompts = []
        limit = info["max_model_len"]
        for i, item in enumerate(body.input):
            param = "input" if len(body.input) == 1 else f"input.{i}"
            if isinstance(item, str):
                if self._max_token_chars is not None and len(item) > limit * self._max_token_chars:
                    raise OpenAIError(f"{param}: {len(item)} characters cannot fit in this model's {limit} tokens",
                                      param=param, code="context_length_exceeded")
                ids = await asyncio.to_thread(self._encode, item, param)
            else:
                ids = list(item)
            try:
                check_token_ids(param, ids, info["vocab_size"])
                check_prompt_fits(len(ids), limit, True, param)
            except RequestError as exc:
                raise request_error(exc) from None
            prompts.append(ids)
        model = self.model_name if lora_request is None else lora_request.lora_name
        jobs = EmbeddingJobs(f"embd-{uuid.uuid4().hex}", model, prompts, pooling,
                             info["block_size"])
        jobs.lora_request = lora_request
        jobs.priority = priority
        return jobs

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except Exception as exc:
            raise OpenAIError(f"{param}: the text cannot be tokenized: {exc}", param=param, code="invalid_value") from None

    @staticmethod
    def body(jobs: EmbeddingJobs, body: EmbeddingRequest, outputs: list[EngineOutput]) -> dict[str, Any]:
        """OpenAI's response body of ``outputs`` (one per input, in order).

        Raises:
            OpenAIError: 500 if a replica ended an input without a vector (never expected).
        """
        data = []
        for index, output in enumerate(outputs):
            if output.embedding is None:
                raise OpenAIError(f"input {index} ended without an embedding ({output.finish_reason})", 500,
                                  type="internal_server_error", code="internal_error")
            vector = encode_base64(output.embedding) if body.encoding_format == "base64" else output.embedding
            data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = jobs.num_prompt_tokens
        return {"object": "list", "data": data, "model": jobs.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
