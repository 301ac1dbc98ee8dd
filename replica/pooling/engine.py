"""The pooling engine: embedding requests on an encoder model (BERT-like), which the paged causal
engine cannot run.

A replica whose model is a pooling model (:func:`~replica.pooling.config.is_pooling_model`) runs
this engine in place of :class:`~replica.engine.llm_engine.LLMEngine`, behind the same
:class:`~replica.engine.async_engine.AsyncLLMEngine` loop: it has the methods and attributes that
loop and the Serve replica read (``make_request``, ``add_prepared_request``, ``step``, ``abort``,
``stats``, ``check_pooling``, ...). Each :meth:`PoolingEngine.step` takes the waiting requests in
arrival order, as many as ``max_num_seqs`` seats and a padded batch of at most
``max_num_batched_tokens`` tokens allow (one at least), runs one forward of the model's transformers
``AutoModel`` over them (right-padded, with an attention mask), pools each row as the model's
sentence-transformers config says (:mod:`replica.pooling.config`: mean over its tokens, its first
token or its last), keeps the first ``dimensions`` components where asked, L2-normalizes where the
model does and finishes them. No KV cache: nothing outlives the step, so a request is waiting or
done, and ``num_running`` is 0 between steps. Generation requests are refused
(:meth:`PoolingEngine.check_pooling`: a 400 at the ingress).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from replica.config.engine_config import EngineConfig
from replica.config.model_files import load_tokenizer, resolve_model_path
from replica.core.request import Request, RequestStatus
from replica.engine.metrics import EngineMetrics
from replica.engine.request_builder import build_request
from replica.engine.stats import EngineStats
from replica.pooling.config import read_pooling_config
from replica.protocol.errors import LoRAAdapterError, RequestError
from replica.protocol.lora_request import LoRARequest
from replica.protocol.outputs import EngineOutput, FinishReason
from replica.protocol.pooling_params import PoolingParams, check_dimensions, matryoshka_of
from replica.protocol.sampling_params import SamplingParams
from replica.worker.model_loader import resolve_dtype
from replica.worker.pooler import pool

logger = logging.getLogger(__name__)


class _Queue:
    """The pooling engine's requests (the part of a scheduler the async loop reads)."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.scheduling_policy = "fcfs"
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}


class _Runner:
    """What the async loop reads of a model runner: its dtype, and no tensor-parallel group."""

    group_broken = False

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device


class PoolingEngine:
    """Embeds requests with a transformers ``AutoModel`` (see the module docstring).

    Args:
        config: the engine settings: ``model``, ``tokenizer``, ``dtype``, ``device``,
            ``max_num_seqs``, ``max_num_batched_tokens`` and ``max_model_len`` apply.
        metrics: where to record Prometheus metrics (None: not recorded).

    Raises:
        ValueError: a ``max_model_len`` past the model's; a pooling mode that is not served.
    """

    embedding_only = True  # serves embedding requests alone (the replica's model_info says so to the ingress)

    def __init__(self, config: EngineConfig | None = None, *, metrics: EngineMetrics | None = None, **kwargs) -> None:
        from transformers import AutoModel

        self.config = cfg = config or EngineConfig(**kwargs)
        self.metrics = metrics
        self.model_path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(self.model_path, cfg.tokenizer)
        self.pooling = read_pooling_config(self.model_path)
        device = torch.device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, cfg.device)
        self.model = AutoModel.from_pretrained(self.model_path, dtype=dtype).to(device).eval()
        self.runner = _Runner(dtype, device)
        hf = self.model.config
        self.vocab_size = hf.vocab_size
        self.hidden_size = hf.hidden_size
        self.matryoshka = matryoshka_of(hf)
        self.pad_token_id = hf.pad_token_id or 0
        longest = min(x for x in (hf.max_position_embeddings, self.pooling.max_seq_length) if x)
        if cfg.max_model_len is not None and cfg.max_model_len > longest:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds this model's {longest} tokens")
        self.max_model_len = cfg.max_model_len or longest
        self.scheduler = _Queue(cfg.max_num_seqs)
        self.eos_token_ids: tuple[int, ...] = ()
        self.grammar_compiler = None
        self.lora = None
        self.speculator = None
        self._ids = itertools.count()
        self._num_steps = 0
        self._step_time_s: float | None = None
        self._refresh_stats()
        logger.info("pooling engine: %s, %s pooling%s, max_model_len=%d", self.model_path, self.pooling.pooling,
                    " + normalize" if self.pooling.normalize else "", self.max_model_len)

    # ---- requests ----------------------------------------------------------------------------
    def embedding_size(self) -> tuple[int, list[int] | bool | None]:
        """``(hidden size, Matryoshka sizes)`` of this model's embeddings (:func:`matryoshka_of`)."""
        return self.hidden_size, self.matryoshka

    def check_pooling(self, params: PoolingParams | None) -> None:
        """Only embedding requests (``params`` not None), with ``dimensions`` the model can give
        (:func:`~replica.protocol.pooling_params.check_dimensions`). Raises ``RequestError``."""
        if params is None:
            raise RequestError(
                f"model: {self.config.model} is an embedding model: it serves /v1/embeddings only, not "
                "completions or chat", "model", "model_not_supported",
            )
        check_dimensions(params, self.hidden_size, self.matryoshka)

    def make_request(self, request_id: str | None = None, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, sampling_params: SamplingParams | None = None,
                     arrival_time: float | None = None, lora_request: LoRARequest | None = None, priority: int = 0) -> Request:
        """A checked request (as :meth:`LLMEngine.make_request <replica.engine.llm_engine.LLMEngine.make_request>`;
        its ``pooling_params`` are set by the caller). Raises ``ValueError``; ``LoRAAdapterError``
        for an adapter (none are served here)."""
        if lora_request is not None:
            raise LoRAAdapterError("LoRA adapters are not served by the pooling engine")
        try:
            return build_request(
                str(request_id) if request_id is not None else f"embd-{next(self._ids)}", prompt, prompt_token_ids,
                sampling_params or SamplingParams(max_tokens=0), arrival_time, tokenizer=self.tokenizer,
                vocab_size=self.vocab_size, max_model_len=self.max_model_len, eos_token_ids=(),
            )
        except ValueError:
            if self.metrics is not None:
                self.metrics.on_rejected()
            raise

    def add_prepared_request(self, request: Request) -> None:
        """Queue a request with pooling parameters. Raises ``ValueError`` on a duplicate id or a
        generation request."""
        self.check_pooling(request.pooling_params)
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.scheduler.requests[request.request_id] = request
        self.scheduler.waiting.append(request)
        self._refresh_stats()

    def abort(self, request_id: str) -> EngineOutput | None:
        """Drop a waiting request: its final output (``abort``), or None if unknown or done."""
        request = self.scheduler.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        self._refresh_stats()
        return request.delta([], "", None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting)

    # ---- one step ----------------------------------------------------------------------------
    def _take_batch(self) -> list[Request]:
        """The next requests in arrival order: seats and the padded token budget allow, one at least."""
        waiting, batch, longest = self.scheduler.waiting, [], 0
        while waiting and len(batch) < self.config.max_num_seqs:
            longest_then = max(longest, waiting[0].num_prompt_tokens)
            if batch and (len(batch) + 1) * longest_then > self.config.max_num_batched_tokens:
                break
            longest = longest_then
            batch.append(waiting.popleft())
        return batch

    def step(self) -> list[EngineOutput]:
        """Embed one batch of waiting requests (see the module docstring); returns their final
        outputs (``embedding`` set; or ``error`` when the forward failed, which ends that batch alone)."""
        started = time.monotonic()
        batch = self._take_batch()
        if not batch:
            return []
        for request in batch:
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = started
            if self.metrics is not None:
                self.metrics.on_first_scheduled(started - request.arrival_time)
        error = None
        try:
            vectors = self._embed(batch)
        except Exception as exc:
            logger.exception("the pooling forward failed for %d requests", len(batch))
            error, vectors = exc, [None] * len(batch)
        now = time.monotonic()
        outputs = []
        for request, vector in zip(batch, vectors):
            self.scheduler.requests.pop(request.request_id, None)
            request.embedding = vector
            request.first_token_time = now
            if self.metrics is not None and error is None:
                self.metrics.on_prompt_prefilled(request.num_prompt_tokens)
            self._finish(request, FinishReason.ABORT if error is not None else FinishReason.STOP)
            output = request.delta([], "", None)
            if error is not None:
                output.error = f"internal error while embedding: {type(error).__name__}: {error}"
            outputs.append(output)
        self._num_steps += 1
        duration = time.monotonic() - started
        self._step_time_s = duration
        if self.metrics is not None:
            self.metrics.on_step(num_tokens=sum(r.num_prompt_tokens for r in batch), num_running=len(batch),
                                 num_slots=self.config.max_num_seqs, duration_s=duration)
        self._refresh_stats()
        return outputs

    @torch.inference_mode()
    def _embed(self, batch: list[Request]) -> list[list[float]]:
        """One right-padded forward of ``batch``'s prompts, each row pooled, cut and normalized."""
        lengths = torch.tensor([r.num_prompt_tokens for r in batch])
        width = int(lengths.max())
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, : len(r.prompt_token_ids)] = torch.tensor(r.prompt_token_ids)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        device = self.runner.device
        hidden = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        mode = self.pooling.pooling
        if mode == "mean":  # sentence-transformers': the mask-weighted sum over the token count
            m = mask.to(device, hidden.dtype).unsqueeze(-1)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        elif mode == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = hidden[torch.arange(len(batch), device=device), (lengths - 1).to(device)]
        return pool(pooled, [r.pooling_params for r in batch], normalize=self.pooling.normalize)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_finished(reason.value, request.finished_time - request.arrival_time)
            if request.embedding is not None:
                self.metrics.on_embedding(request.num_prompt_tokens, request.finished_time - request.arrival_time)

    # ---- what the replica reads ----------------------------------------------------------------
    def _refresh_stats(self) -> None:
        waiting = self.scheduler.waiting
        self._stats = EngineStats(
            num_slots=self.config.max_num_seqs, num_running=0, num_waiting=len(waiting), num_free_blocks=0,
            num_total_blocks=0, kv_cache_usage=0.0, num_preemptions=0, num_steps=self._num_steps,
            head_waiting_since=waiting[0].arrival_time if waiting else None, step_time_s=self._step_time_s,
            token_budget=self.config.max_num_batched_tokens,
        )
        if self.metrics is not None:
            self.metrics.on_state(num_slots=self.config.max_num_seqs, num_running=0, num_waiting=len(waiting),
                                  num_free_blocks=0, num_total_blocks=0)

    def stats(self) -> EngineStats:
        """The latest snapshot (taken after every step and command; safe from any thread)."""
        return self._stats

    def check_integrity(self) -> None:
        """No request outlives its step: none is running. Raises ``AssertionError``."""
        assert all(r.status == RequestStatus.WAITING for r in self.scheduler.waiting)
        assert set(self.scheduler.requests) == {r.request_id for r in self.scheduler.waiting}

    def lora_stats(self) -> None:
        return None

    def remove_lora(self, lora_name: str) -> bool:
        return False

    def close(self) -> None:
        """Nothing to stop (one process, no tensor-parallel ranks)."""
