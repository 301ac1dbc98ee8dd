"""Scheduler output → flat tensors → one forward of a transformers model → sampled tokens.

With its helpers (:mod:`replica.worker.warm_up`, :mod:`replica.worker.cuda_graphs`), the only engine module that
builds tensors. Per step: the step's flat inputs from the persistent batch
(:mod:`replica.worker.input_batch`: ``input_ids``, ``positions``, ``slot_mapping``, each ``[num_tokens]``,
one host-to-device copy), one plan of the attention backend (:mod:`replica.attention.reference`),
one forward with our paged attention, logits only where a token is sampled (``logits_to_keep``).

Fast paths (:mod:`replica.worker.compilation`): on CPU, linear layers use prepacked weights (float32 ones
Carpool's kernel), bfloat16/float16 steps are padded to a few token counts
(:func:`replica.kernels.shapes.padded_size`), and float32 steps to 4 rows at least where Carpool's
kernel is not built (``FLOAT32_MIN_ROWS``); ``compile`` (the default) runs the decoder under
torch.compile, ``compile=False`` eagerly. Compiled on CPU with Carpool's kernel, every step
(decodes and prefill chunks) runs its attention as one decode query per token inside the graph
(:meth:`ModelRunner.decode_arrays`). On CUDA, decode-only steps replay CUDA graphs.

A step is :meth:`ModelRunner.launch` (inputs and forward) then sampling: at once
(:meth:`ModelRunner.execute`), or, with async scheduling, :meth:`ModelRunner.sample_later`, whose
tokens stay on the device until the engine reads them a step later.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.profiler import record_function

from replica.attention.backend import DecodeStep, to_device
from replica.attention.cpu import CpuBackend, inline_chunks
from replica.attention.op import attach_kv_cache, register_paged_attention, running_step, set_max_model_len
from replica.attention.selector import make_backend
from replica.config.engine_config import cache_dir
from replica.core.request import RequestStatus
from replica.core.scheduler_output import SchedulerOutput
from replica.sample.logprobs import token_logprobs
from replica.sample.sampler import Sampler, cpu_inversion
from replica.worker.compilation import compile_decoder, mark_step_dynamic, prepack_linears, use_compile_cache
from replica.worker.cuda_graphs import MAX_GRAPH_CONTEXT, DecodeGraphs, graph_memory_reserve
from replica.worker.input_batch import InputBatch, ModelInputs
from replica.worker.kv_cache import PagedKVCache, kv_bytes_per_block, model_shape
from replica.worker.kv_sizing import decide_num_blocks
from replica.worker.model_loader import load_model, resolve_dtype
from replica.worker.model_runner_output import ModelRunnerOutput, PendingTokens
from replica.worker.model_support import check_supported, probe_attention

__all__ = ["ModelRunner", "PendingTokens", "ModelRunnerOutput"]

logger = logging.getLogger(__name__)

# On an AVX2 CPU (Zen 3, one thread, measured) torch's float32 linear gives 1 to 3 rows other bits
# than the same rows among 4 to 300, which agree: where Carpool's float32 kernel (batch-invariant)
# is not built, CPU float32 steps run 4 tokens and rows at least. (With 2 threads other small
# counts differ too: a replica runs one thread per core.)
FLOAT32_MIN_ROWS = 4


class ModelRunner:
    """Owns the model, the paged KV cache, the attention backend and the sampler of one engine.

    Args:
        model_path: local folder of the model (see ``replica.config.model_files.resolve_model_path``).
        dtype, device: as in ``EngineConfig``.
        block_size: tokens per block.
        num_blocks / kv_cache_memory: the pool size in blocks, or a byte budget (see
            :func:`~replica.worker.kv_sizing.decide_num_blocks`).
        attention_backend: ``auto`` (the device's fast backend), ``reference``, ``cpu`` or ``cuda``.
        compile: torch.compile the decoder layers (see :mod:`replica.worker.compilation`).
        cuda_graphs: on CUDA with ``compile``, replay decode-only steps from CUDA graphs
            (:mod:`replica.worker.cuda_graphs`); the default KV budget then leaves room for their memory.
        max_num_seqs: the engine's seats (sizes the graphs' memory reserve).
    Raises:
        ValueError: an unknown or unavailable attention backend.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        device: str,
        block_size: int,
        num_blocks: int | None,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        compile: bool = False,
        cuda_graphs: bool = True,
        max_num_seqs: int = 256,
    ) -> None:
        self.device = torch.device(device)
        self.use_cuda_graphs = cuda_graphs and compile and self.device.type == "cuda"
        self.max_num_seqs = max_num_seqs
        self.dtype = resolve_dtype(dtype, device)
        self.block_size = block_size
        self.model = load_model(
            model_path, dtype=self.dtype, device=device, attn_implementation=register_paged_attention()
        )
        check_supported(self.model)
        self.shape = model_shape(self.model.config)
        self.hf_config = self.model.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]  # before prepacking frees it
        shape = self.shape
        per_block = kv_bytes_per_block(shape.num_layers, block_size, shape.num_kv_heads, shape.head_dim, self.dtype)
        graph_reserve = graph_memory_reserve(
            max_num_seqs, shape.max_position_embeddings or MAX_GRAPH_CONTEXT, shape.num_heads, self.vocab_size
        ) if self.use_cuda_graphs else 0
        self.num_blocks = decide_num_blocks(
            num_blocks, kv_cache_memory, gpu_memory_utilization, per_block, self.device, reserve=graph_reserve
        )
        # Padding tokens write their K/V into one extra block that no block table holds.
        self.padding_slot = self.num_blocks * block_size
        self.kv_cache = PagedKVCache(
            num_layers=self.shape.num_layers,
            num_blocks=self.num_blocks + 1,
            block_size=block_size,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.compiled = compile
        shape = self.shape
        self.backend = make_backend(attention_backend, self.device, self.block_size, compiled=self.compiled,
                                    num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                    head_dim=shape.head_dim, dtype=self.dtype)
        attach_kv_cache(self.model, self.kv_cache.key_cache, self.kv_cache.value_cache)
        sixteen_bit = self.dtype in (torch.bfloat16, torch.float16)
        if self.device.type == "cpu":
            cpu_inversion()  # build or load the CPU kernels now (the sampler's, the linears')
        self.num_packed = prepack_linears(self.model) if self.device.type == "cpu" else 0
        if not probe_attention(self):  # the layers drop the DecodeStep: plan every step on the backend
            self.backend.inline_decode = False
            self.use_cuda_graphs = False
        if compile:
            use_compile_cache(str(cache_dir() / "inductor"))
            compile_decoder(self.model)
        # The compiled decoder sees at least 2 tokens and 2 block-table columns (see compilation).
        self.min_step_tokens = 2 if compile else 1
        # On CPU in 16-bit dtypes (oneDNN's attention and matmuls build a kernel per shape; Carpool's
        # linear kernels take any size), steps are padded to a few sizes (see padded_size).
        self.pad_steps = self.device.type == "cpu" and sixteen_bit
        float32_blas = self.device.type == "cpu" and self.dtype == torch.float32 and not self.num_packed
        self.min_rows = FLOAT32_MIN_ROWS if float32_blas else 1
        self.sampler = Sampler()
        self.input_batch: InputBatch | None = None
        self.graphs: DecodeGraphs | None = None

    @property
    def pad_steps(self) -> bool:
        """Pad each step's token count and logits rows (and the prefill attention's query and
        key lengths) to :func:`padded_size` buckets."""
        return self._pad_steps

    @pad_steps.setter
    def pad_steps(self, value: bool) -> None:
        self._pad_steps = value
        if isinstance(self.backend, CpuBackend):
            self.backend.pad_shapes = value

    def init_batch(self, max_num_seqs: int, max_model_len: int) -> None:
        """Allocate the persistent batch (``max_num_seqs`` rows of ``max_model_len`` tokens), and
        give the attention layers ``max_model_len`` (:func:`set_max_model_len`)."""
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.block_size, self.padding_slot)
        set_max_model_len(self.model, max_model_len)
        if self.use_cuda_graphs:
            self.enable_decode_graphs(capture=True)

    def enable_decode_graphs(self, *, capture: bool) -> None:
        """Run decode-only steps through :class:`DecodeGraphs` (after :meth:`init_batch`); with
        ``capture=False`` (any device) the padded static-buffer path runs without CUDA graphs."""
        batch = self.input_batch
        self.graphs = DecodeGraphs(
            self._graph_forward, max_num_seqs=batch.block_table.shape[0], max_blocks=batch.block_table.shape[1],
            block_size=self.block_size, spare_block=self.num_blocks, device=self.device, capture=capture,
        )

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, decode: DecodeStep) -> torch.Tensor:
        """A decode step's logits ``[B, vocab]`` with attention traced into the decoder."""
        with running_step(self.backend):
            out = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=0, carpool_decode=decode
            )
        return out.logits[0]

    def forget(self, request_id: str) -> None:
        """The request left the running batch (finished, aborted or preempted)."""
        self.input_batch.forget(request_id)

    @torch.inference_mode()
    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, float]:
        """Do at engine start what would otherwise slow the first requests down or grow memory
        while serving (:func:`replica.worker.warm_up.warm_up`); returns what it did (counts and seconds)."""
        from replica.worker.warm_up import warm_up

        return warm_up(self, max_num_batched_tokens, max_num_seqs)

    def decode_arrays(self, seqs) -> list[np.ndarray]:
        """A decode-like step's attention inputs (:class:`~replica.attention.backend.DecodeStep`), one query
        per token: a prefill chunk's token ``j`` becomes a query of its sequence's block table that
        sees the sequence's first ``context_len + j + 1`` tokens (causal attention, one query at a
        time), and padding tokens one-token sequences on the spare block."""
        num_real = int(seqs.query_lens.sum())
        extra = seqs.num_tokens - num_real
        tables, lens = seqs.block_tables, seqs.seq_lens
        if num_real != seqs.num_seqs:  # prefill chunks: one row per token, in token order
            _, rows, lens = seqs.decode_queries(np.arange(seqs.num_seqs))
            tables = tables[rows]
        if tables.shape[1] < self.min_step_tokens:
            tables = np.concatenate([tables, np.full((len(tables), 1), self.num_blocks, dtype=tables.dtype)], axis=1)
        if extra:
            pad_tables = np.full((extra, tables.shape[1]), self.num_blocks, dtype=tables.dtype)
            tables = np.concatenate([tables, pad_tables])
            lens = np.concatenate([lens, np.ones(extra, dtype=lens.dtype)])
        return [seqs.slot_mapping, tables, lens]

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward for ``out``, sample the rows that reach their last known token and score
        the prompt positions whose logprobs are asked for."""
        return self._sample(*self.launch(out))

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, previous: PendingTokens | None = None
    ) -> tuple[SchedulerOutput, ModelInputs, torch.Tensor]:
        """Prepare ``out``'s inputs and run its forward (on CUDA: launch it); returns what
        :meth:`sample_later` (or the sampling of :meth:`execute`) takes, with the logits
        ``[num_logits_rows, vocab]``. Rows marked ``from_previous`` (async scheduling) take their
        input token from ``previous`` on the device."""
        with record_function("carpool.prepare_inputs"):
            inputs = self.input_batch.prepare(
                out.scheduled, pad=self.pad_steps, min_tokens=self.min_step_tokens, min_rows=self.min_rows
            )
            seqs = inputs.sequences
            arrays = [inputs.input_ids, inputs.positions, inputs.logits_indices]
            all_decodes = bool((seqs.query_lens == 1).all())
            patch = None
            if any(s.from_previous for s in out.scheduled):
                if previous is None:
                    raise RuntimeError("a row takes its input token from a step in flight, but none is")
                patch = previous.inputs_for(out.scheduled, seqs.query_start, self.device)
        if self.graphs is not None and all_decodes and len(inputs.sample_rows) == seqs.num_seqs and not inputs.prompt_spans:
            with record_function("carpool.forward"):
                n = seqs.num_seqs
                logits = self.graphs.run(
                    inputs.input_ids[:n], inputs.positions[:n], seqs.slot_mapping[:n], seqs.block_tables, seqs.seq_lens,
                    patch=patch,
                )
            if logits is not None:
                return out, inputs, logits
        with record_function("carpool.prepare_inputs"):
            # Prefill chunks run as one decode query per token (decode_arrays): the step
            # then takes the decode graph, whose attention is Carpool's kernel traced in, instead
            # of the opaque op's gather, padding and SDPA per layer.
            decode_only = self.compiled and self.backend.inline_decode and (
                all_decodes or bool(inline_chunks(seqs, self.backend.inline_chunk_pairs).all())
            )
            if decode_only:
                arrays += self.decode_arrays(seqs)
            else:
                self.backend.plan(seqs)
            input_ids, positions, logits_indices, *decode = to_device(arrays, self.device)
            if patch is not None:
                input_ids.index_copy_(0, *patch)
            # [1, T] with the strides of a fresh tensor, as in the warm-up (a numpy [None] view has a
            # zero stride, which the compiled graph's guards would tell apart and compile again for).
            input_ids, positions = input_ids.unsqueeze(0), positions.unsqueeze(0)
        extra = {}
        if decode_only:
            extra["carpool_decode"] = DecodeStep(*decode, block_size=self.block_size)
        if self.compiled:
            mark_step_dynamic(input_ids, positions, extra.get("carpool_decode"))
        with running_step(self.backend), record_function("carpool.forward"):
            logits = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=logits_indices,
                **extra,
            ).logits[0]  # [num_logits_rows, vocab]
        return out, inputs, logits

    @torch.inference_mode()
    def sample_later(self, launched: tuple[SchedulerOutput, ModelInputs, torch.Tensor]) -> PendingTokens:
        """Sample a launched step (:meth:`launch`) without reading its tokens back: the rows of
        requests still running (a request that ended since it was scheduled gets no token). A step
        with logprobs, prompt logprobs or a sampling error is sampled as :meth:`execute` does."""
        out, inputs, logits = launched
        keep = [k for k, row in enumerate(inputs.sample_rows) if out.scheduled[row].request.status == RequestStatus.RUNNING]
        requests = [out.scheduled[inputs.sample_rows[k]].request for k in keep]
        plain = (
            not inputs.prompt_spans
            and all(r.sampling_params.logprobs is None for r in requests)
            and not any(s.is_padding for s in out.scheduled)  # static baseline's padding rows: _sample
        )
        if plain:
            self._seed_generators(requests)
            rows = logits[: len(inputs.sample_rows)]
            if len(keep) < len(inputs.sample_rows):
                rows = rows.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
            try:
                with record_function("carpool.sample"):
                    tokens = self.sampler.sample_ids(rows, requests) if requests else rows.new_empty(0, dtype=torch.int64)
            except Exception:
                logger.exception("batched sampling failed; sampling the step's rows one by one")
            else:
                rows_of = [inputs.sample_rows[k] for k in keep]
                return PendingTokens([r.request_id for r in requests], rows_of, tokens, len(out.scheduled))
        result = self._sample(out, inputs, logits)
        ids = [None if s.is_padding else s.request.request_id for s in out.scheduled]  # static padding: no next step
        return PendingTokens.done(result, ids, self.device)

    def _seed_generators(self, requests) -> None:
        for request in requests:
            if request.sampling_params.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)

    def _sample(self, out: SchedulerOutput, inputs, logits: torch.Tensor) -> ModelRunnerOutput:
        """Sample the step's sampling rows and score its prompt rows from ``logits``
        ``[num_logits_rows, vocab]`` (sampling rows first, then prompt rows, then step padding)."""
        sample_rows = inputs.sample_rows
        num_real_rows = len(sample_rows)
        result = ModelRunnerOutput([None] * len(out.scheduled), [None] * len(out.scheduled))
        if inputs.prompt_spans:
            with record_function("carpool.prompt_logprobs"):
                self._score_prompts(out, inputs, logits[num_real_rows : num_real_rows + inputs.num_prompt_rows], result)
        logits = logits[:num_real_rows]  # [num_sampling_rows, vocab]
        if not sample_rows:
            return result

        # Rows of running requests (async scheduling: one that ended since it was scheduled gets none).
        real = [i for i, row in enumerate(sample_rows) if out.scheduled[row].request.status == RequestStatus.RUNNING]
        static_padding = [i for i, row in enumerate(sample_rows) if out.scheduled[row].is_padding]
        if real:
            requests = [out.scheduled[sample_rows[i]].request for i in real]
            self._seed_generators(requests)
            real_logits = logits if len(real) == len(sample_rows) else logits[real]
            try:
                with record_function("carpool.sample"):
                    sampled = self.sampler(real_logits, requests)
            except Exception:
                # One request's parameters or state may break the batched sampler: sample each
                # row alone, so that only the rows that fail by themselves fail.
                logger.exception("batched sampling failed; sampling the %d rows one by one", len(real))
                for k, (i, request) in enumerate(zip(real, requests)):
                    row = sample_rows[i]
                    try:
                        one = self.sampler(real_logits[k : k + 1], [request])
                    except Exception as exc:
                        result.errors[row] = exc
                        continue
                    result.sampled_token_ids[row] = one.token_ids[0]
                    result.logprobs[row] = one.logprobs[0]
            else:
                for i, token_id, lp in zip(real, sampled.token_ids, sampled.logprobs):
                    result.sampled_token_ids[sample_rows[i]] = token_id
                    result.logprobs[sample_rows[i]] = lp
        if static_padding:
            # Static baseline: finished members' rows, computed as in a padded batch; tokens thrown away.
            for i, token_id in zip(static_padding, logits[static_padding].argmax(dim=-1).tolist()):
                result.sampled_token_ids[sample_rows[i]] = token_id
        return result

    def _score_prompts(self, out: SchedulerOutput, inputs, logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Prompt logprobs of ``inputs.prompt_spans`` from their logits rows ``[num_prompt_rows, V]``
        into ``result.prompt_logprobs``; a failure ends only the requests of those rows."""
        targets: list[int] = []
        ks: list[int] = []
        for i, first, end in inputs.prompt_spans:
            request = out.scheduled[i].request
            targets.extend(request.prompt_token_ids[first + 1 : end + 1])  # position q scores token q + 1
            ks.extend([request.sampling_params.prompt_logprobs] * (end - first))
        try:
            entries = token_logprobs(logits, torch.tensor(targets, device=logits.device), ks)
        except Exception as exc:
            logger.exception("prompt logprobs failed for %d rows", len(targets))
            for i, _, _ in inputs.prompt_spans:
                result.errors[i] = exc
            return
        offset = 0
        for i, first, end in inputs.prompt_spans:
            result.prompt_logprobs[i] = entries[offset : offset + end - first]
            offset += end - first
