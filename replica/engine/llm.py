"""Offline batch inference shaped like vLLM's ``LLM``: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from replica.config.engine_config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.protocol.lora_request import LoRARequest
from replica.protocol.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from replica.protocol.pooling_params import PoolingParams, embedding_sampling_params
from replica.protocol.sampling_params import SamplingParams


class LLM:
    """Generate for many prompts at once with continuous batching, in this process.

    Keyword arguments are :class:`~replica.config.engine_config.EngineConfig` fields (``model``, ``dtype``,
    ``device``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``num_blocks`` or
    ``kv_cache_memory`` (bytes), ``max_model_len``, ``batching_policy``, ``scheduling_policy``).

    Example::

        llm = LLM(dtype="float32")
        [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        print(out.outputs[0].text, out.outputs[0].finish_reason)
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (the object is unusable after)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        Args:
            prompts: text prompts (a single string is one prompt).
            sampling_params: one for all prompts, or one per prompt (default: vLLM's defaults).
            prompt_token_ids: token id prompts, instead of ``prompts``.
            use_tqdm: show a progress bar of finished requests.
            lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model).
            priority: one per prompt, as vLLM's (lower runs first; only with
                ``scheduling_policy="priority"``); None: all 0.
        Raises:
            ValueError: a bad prompt or parameter, an adapter that cannot be used
                (``LoRAAdapterError``), a ``priority`` list of another length or a nonzero
                priority under ``"fcfs"`` (``RequestError``); nothing is queued then.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        items = list(prompts) if prompts is not None else [list(p) for p in prompt_token_ids]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(items)} prompts")

        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(items)
        else:
            loras = list(lora_request)
            if len(loras) != len(items):
                raise ValueError(f"lora_request has {len(loras)} entries for {len(items)} prompts")

        if priority is not None and not isinstance(priority, Sequence):
            raise ValueError(f"priority must be one int per prompt (a list), got {type(priority).__name__}")
        priorities = [0] * len(items) if priority is None else list(priority)
        if len(priorities) != len(items):
            raise ValueError(f"priority has {len(priorities)} entries for {len(items)} prompts")

        engine = self.engine
        requests = []  # (prompt index, sequence index, Request)
        for i, (item, params, lora, prio) in enumerate(zip(items, params_list, loras, priorities)):
            for j in range(params.n):
                seq_params = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + j
                    seq_params = dataclasses.replace(params, n=1, seed=seed)
                text, ids = (item, None) if prompts is not None else (None, item)
                requests.append((i, j, engine.make_request(None, text, ids, seq_params, None, lora, prio)))
        for _, _, request in requests:
            engine.add_prepared_request(request)

        texts: dict[str, list[str]] = {r.request_id: [] for _, _, r in requests}
        logprobs: dict[str, list] = {r.request_id: [] for _, _, r in requests}
        prompt_logprobs: dict[str, list] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req")
        while engine.has_unfinished_requests():
            for delta in engine.step():
                texts[delta.request_id].append(delta.new_text)
                if delta.new_logprobs:
                    logprobs[delta.request_id].extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[delta.request_id] = delta.prompt_logprobs
                if delta.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

        results: list[RequestOutput] = []
        for i, item in enumerate(items):
            members = [(j, r) for k, j, r in requests if k == i]
            first = members[0][1]
            results.append(
                RequestOutput(
                    request_id=first.request_id,
                    prompt=item if prompts is not None else None,
                    prompt_token_ids=first.prompt_token_ids,
                    outputs=[
                        CompletionOutput(
                            index=j,
                            text="".join(texts[r.request_id]),
                            token_ids=list(r.output_token_ids),
                            finish_reason=r.finish_reason.value if r.finish_reason else None,
                            stop_reason=r.stop_reason,
                            logprobs=logprobs[r.request_id] if r.sampling_params.logprobs is not None else None,
                        )
                        for j, r in members
                    ],
                    finished=all(r.is_finished for _, r in members),
                    metrics=_latency_metrics(first),
                    prompt_logprobs=prompt_logprobs.get(first.request_id),
                    num_cached_tokens=max(first.num_cached_tokens, 0),
                )
            )
        return results


    def embed(
        self,
        prompts: str | Sequence[str] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``): each runs as a prefill-only request whose last
        prompt token's final hidden state is pooled (``docs/embeddings.md``); outputs in the
        prompts' order. :func:`embed_all` on this engine."""
        return embed_all(self.engine, prompts, prompt_token_ids=prompt_token_ids, pooling_params=pooling_params)


def embed_all(
    engine,
    prompts: str | Sequence[str] | None = None,
    *,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    pooling_params: PoolingParams | None = None,
) -> list[EmbeddingRequestOutput]:
    """Embed every prompt on ``engine`` (an :class:`LLMEngine`, or a
    :class:`~replica.pooling.engine.PoolingEngine`: the same request methods) until all are done;
    outputs in the prompts' order.

    Raises:
        ValueError: a bad prompt (as :meth:`LLM.generate`), ``dimensions`` the model cannot give
            (``RequestError``); nothing is queued then.
        RuntimeError: a request ended without its vector (its step failed), naming it (as
            vLLM's ``LLM.embed``, which raises rather than return a partial result).
    """
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts or prompt_token_ids")
    if isinstance(prompts, str):
        prompts = [prompts]
    items = list(prompts) if prompts is not None else [list(p) for p in prompt_token_ids]
    params = pooling_params or PoolingParams()
    engine.check_pooling(params)
    requests = []
    for item in items:
        text, ids = (item, None) if prompts is not None else (None, item)
        request = engine.make_request(None, text, ids, embedding_sampling_params())
        request.pooling_params = params
        requests.append(request)
    for request in requests:
        engine.add_prepared_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    if failed := [r.request_id for r in requests if r.embedding is None]:
        raise RuntimeError(f"{len(failed)} embedding request(s) ended without a vector ({', '.join(failed[:4])}): see the log")
    return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.embedding)) for r in requests]


def _latency_metrics(request) -> dict[str, float]:
    """Seconds from arrival: time to first token and end-to-end latency; the finishing step."""
    metrics: dict[str, float] = {}
    if request.first_token_time is not None:
        metrics["ttft_s"] = request.first_token_time - request.arrival_time
    if request.finished_time is not None:
        metrics["e2e_s"] = request.finished_time - request.arrival_time
    if request.finish_step is not None:
        metrics["finish_step"] = request.finish_step
    return metrics
