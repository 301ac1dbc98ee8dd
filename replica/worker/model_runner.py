"""Scheduler output → flat tensors → one forward of a transformers model → sampled tokens.

With its helpers (:mod:`replica.worker.warm_up`, :mod:`replica.worker.cuda_graphs`), the only engine module that
builds tensors. Per step: the step's flat inputs from the persistent batch
(:mod:`replica.worker.input_batch`: ``input_ids``, ``positions``, ``slot_mapping``, each ``[num_tokens]``,
one host-to-device copy), one plan of the attention backend (:mod:`replica.attention.reference`),
one forward with our paged attention, logits only where a token is sampled (``logits_to_keep``)
or an embedding request's last prompt token is pooled (:mod:`replica.worker.pooler`).

Fast paths (:mod:`replica.worker.compilation`): on CPU, linear layers use prepacked weights (float32 ones
Carpool's kernel), bfloat16/float16 steps are padded to a few token counts
(:func:`replica.kernels.shapes.padded_size`), and float32 steps to 4 rows at least where Carpool's
kernel is not built (:data:`replica.kernels.shapes.FLOAT32_MIN_ROWS`); ``compile`` (the default) runs the decoder under
torch.compile, ``compile=False`` eagerly. Compiled on CPU with Carpool's kernel, every step
(decodes and prefill chunks) runs its attention as one decode query per token inside the graph
(:meth:`ModelRunner.decode_arrays`). On CUDA, decode-only steps replay CUDA graphs.

A step is :meth:`ModelRunner.launch` (inputs and forward) then sampling
(:mod:`replica.worker.step_sampler`): at once (:meth:`ModelRunner.execute`), or, with async
scheduling, :meth:`ModelRunner.sample_later`, whose tokens stay on the device until the engine
reads them a step later.

Tensor parallelism (:mod:`replica.worker.parallel`): with ``tensor_parallel_size`` N > 1 the
runner of rank 0 starts N - 1 more (:mod:`replica.worker.tp_launch`), each on its shard of the
model (:mod:`replica.worker.tp_worker`), and before each of :meth:`ModelRunner.init_batch`, :meth:`ModelRunner.warm_up`,
:meth:`ModelRunner.enable_decode_graphs` and :meth:`ModelRunner.forward` broadcasts the call (the
step message: the step's :class:`~replica.worker.input_batch.ModelInputs`), which every other
rank replays, so that all ranks run the same forwards with the same shapes and collectives.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np
import torch
from torch.profiler import record_function

from replica.attention.backend import DecodeStep, to_device
from replica.attention.cpu import CpuBackend, inline_chunks
from replica.attention.op import attach_kv_cache, register_paged_attention, running_step, set_max_model_len
from replica.attention.selector import make_backend
from replica.config.engine_config import cache_dir
from replica.config.model_files import check_tp_size
from replica.kernels.shapes import FLOAT32_MIN_ROWS
from replica.core.scheduler_output import SchedulerOutput
from replica.lora.layers import wrap_forwards
from replica.lora.slots import make_slots
from replica.quant.checkpoint import check_checkpoint
from replica.quant.convert import as_compressed
from replica.sample.sampler import cpu_inversion
from replica.worker.compilation import compile_decoder, mark_step_dynamic, prepack_linears, use_compile_cache
from replica.worker.cuda_graphs import MAX_GRAPH_CONTEXT, DecodeGraphs, graph_memory_reserve
from replica.worker.input_batch import InputBatch, ModelInputs, decode_arrays
from replica.worker.kv_cache import PagedKVCache, kv_bytes_per_block, model_shape
from replica.worker.kv_sizing import decide_num_blocks
from replica.worker.model_loader import load_model, quantize_linears, resolve_dtype
from replica.worker.model_runner_output import ModelRunnerOutput, PendingTokens
from replica.worker.model_support import check_supported, probe_attention
from replica.worker.pooler import capture_head_input
from replica.worker.parallel import TPGroup, abandon_group, install_forwards, localize, shared_reducer
from replica.worker.step_sampler import StepSampler
from replica.worker.tp_launch import start_ranks

__all__ = ["ModelRunner", "PendingTokens", "ModelRunnerOutput"]


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
        tensor_parallel_size: ranks the model is sharded over (:mod:`replica.worker.parallel`);
            with more than one, this runner is rank 0 and starts the others with ``launch_ranks``
            (:func:`~replica.worker.tp_launch.start_ranks`), unless ``tp`` says it is one of them.
        lora: ``(max_loras, max_lora_rank, max step tokens)`` to serve LoRA adapters
            (:mod:`replica.lora`): every linear layer of the decoder layers gets slots.
        gguf_file: the GGUF file the model was converted from, to compute its linear layers from
            the file's blocks (:mod:`replica.quant.gguf_blocks`' types; ``quantization: gguf``);
        quantization: the engine's; ``int8`` or ``int4`` quantizes them at load (:mod:`replica.quant.online`).
    Raises:
        ValueError: an unknown or unavailable attention backend; a ``tensor_parallel_size`` the
            model's heads do not split over; ``gguf_file``, ``int8`` or ``int4`` where the block
            kernels are not built for the dtype (:func:`~replica.worker.model_loader.quantize_linears`), or a file
            :func:`~replica.quant.gguf_weights.quantize_from_gguf` refuses.
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
        tensor_parallel_size: int = 1,
        lora: tuple[int, int, int] | None = None,
        gguf_file: str | None = None,
        quantization: str | None = None,
        launch_ranks=None,
        tp: TPGroup | None = None,
    ) -> None:
        runner_kwargs = {k: v for k, v in locals().items() if k not in ("self", "launch_ranks", "tp")}
        if tensor_parallel_size > 1:
            check_tp_size(model_path, tensor_parallel_size)
            tp = tp or start_ranks(tensor_parallel_size, runner_kwargs, launch_ranks)
        self.tp = tp
        # Rank 0's engine dropped without close(): its other ranks end with it.
        self._abandon = weakref.finalize(self, abandon_group, tp) if tp is not None and tp.rank == 0 else None
        try:
            self.device = torch.device(device)
            self.use_cuda_graphs = cuda_graphs and compile and self.device.type == "cuda"
            self.max_num_seqs = max_num_seqs
            self.dtype = resolve_dtype(dtype, device)
            self.block_size = block_size
            check_checkpoint(model_path, quantization, tensor_parallel_size)  # a quantized config Carpool refuses, by name
            converted = as_compressed(model_path)  # AWQ and GPTQ: their compressed-tensors copy, checked as one
            if converted != model_path:
                model_path = converted
                check_checkpoint(model_path, None, tensor_parallel_size)
            self.model = load_model(
                model_path, dtype=self.dtype, device=device, attn_implementation=register_paged_attention(),
                tp_size=tensor_parallel_size,
            )
            check_supported(self.model)
            self.shape = model_shape(self.model.config, tensor_parallel_size)  # this rank's heads
            self.hf_config = self.model.config
            head = self.model.get_output_embeddings()  # its weight before prepacking frees it (a compressed head has none)
            self.vocab_size = head.weight.shape[0] if hasattr(head, "weight") else head.out_features
            tp_layers = localize(self.model) if tp is not None else []
            # The base layers on blocks first: LoRA's own A and B layers (make_slots) stay dense.
            self.num_quantized = quantize_linears(self.model, self.dtype, gguf_file, quantization)
            self.lora = make_slots(self.model, max_loras=lora[0], max_rank=lora[1], max_tokens=lora[2]) if lora else None
            shape = self.shape
            per_block = kv_bytes_per_block(shape.num_layers, block_size, shape.num_kv_heads, shape.head_dim, self.dtype)
            graph_reserve = graph_memory_reserve(
                max_num_seqs, shape.max_position_embeddings or MAX_GRAPH_CONTEXT, shape.num_heads, self.vocab_size
            ) if self.use_cuda_graphs else 0
            self.num_blocks = decide_num_blocks(
                num_blocks, kv_cache_memory, gpu_memory_utilization, per_block, self.device, reserve=graph_reserve
            )
            if tp is not None:  # every rank's pool has the same blocks
                self.num_blocks = tp.min_over_ranks(self.num_blocks)
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
            if self.lora is not None:
                wrap_forwards(self.lora.modules)
            if tp_layers:  # on CPU the row-wise layers sum through shared memory where it serves
                hidden_bytes = self.hf_config.get_text_config().hidden_size * self.dtype.itemsize
                logits_bytes = -(-self.vocab_size // tp.world_size) * self.dtype.itemsize * self.max_num_seqs
                self.reducer = shared_reducer(tp, hidden_bytes, logits_bytes) if self.device.type == "cpu" else None
                install_forwards(tp_layers, self.device, self.reducer)
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
            self.step_sampler = StepSampler(self.device)
            self.input_batch: InputBatch | None = None
            self.graphs: DecodeGraphs | None = None
        except BaseException:  # the other ranks would wait for this one forever
            self.close(kill=True)
            raise

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
        self._command("init_batch", max_num_seqs, max_model_len)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.block_size, self.padding_slot, self.device)
        self.step_sampler.seats = self.input_batch.sampling
        set_max_model_len(self.model, max_model_len)
        if self.use_cuda_graphs:
            self._make_graphs(capture=True)

    def enable_decode_graphs(self, *, capture: bool) -> None:
        """Run decode-only steps through :class:`DecodeGraphs` (after :meth:`init_batch`); with
        ``capture=False`` (any device) the padded static-buffer path runs without CUDA graphs."""
        self._command("enable_decode_graphs", capture)
        self._make_graphs(capture)

    def _make_graphs(self, capture: bool) -> None:
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

        self._command("warm_up", max_num_batched_tokens, max_num_seqs)
        return warm_up(self, max_num_batched_tokens, max_num_seqs)

    # ---- tensor parallelism (replica.worker.parallel) -------------------------------------------
    @torch.inference_mode()
    def time_forwards(self, num_tokens: list[int], chunk: int) -> list[float]:
        """Seconds of a forward of each of ``num_tokens`` tokens (:func:`replica.worker.warm_up.time_forwards`;
        every rank runs them), for the speculative-decoding planner's step cost."""
        from replica.worker.warm_up import time_forwards

        self._command("time_forwards", num_tokens, chunk)
        return time_forwards(self, num_tokens, chunk)

    def _command(self, name: str, *args) -> None:
        """Rank 0 of a tensor-parallel group: have the other ranks run ``name(*args)`` too
        (:func:`~replica.worker.tp_worker.run_rank`), before running it here."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.broadcast((name, args))

    @property
    def group_broken(self) -> bool:
        """Whether this runner's tensor-parallel group can no longer run steps: a rank has ended,
        or a forward failed part-way (False at TP 1)."""
        return self.tp is not None and (self.tp.broken or not self.tp.ranks_alive())

    def close(self, *, kill: bool = False) -> None:
        """Rank 0: end the other ranks' loops, or with ``kill`` the ranks themselves (when they
        may be inside a collective), and leave the group (idempotent; nothing at TP 1)."""
        tp, self.tp = self.tp, None
        if tp is None or self._abandon is None:  # TP 1, closed already, or not rank 0
            return
        if kill or not tp.ranks_alive():
            self._abandon()  # abandon_group, once
            return
        self._abandon.detach()
        try:
            tp.broadcast(None)
        finally:
            tp.close()

    def decode_arrays(self, seqs) -> list[np.ndarray]:
        """A decode-like step's attention inputs, one query per token
        (:func:`~replica.worker.input_batch.decode_arrays`)."""
        return decode_arrays(seqs, min_columns=self.min_step_tokens, spare_block=self.num_blocks)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward for ``out``, sample the rows that reach their last known token and score
        the prompt positions whose logprobs are asked for."""
        return self.step_sampler.sample(*self.launch(out))

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
            patch = None
            if any(s.from_previous for s in out.scheduled):
                if previous is None:
                    raise RuntimeError("a row takes its input token from a step in flight, but none is")
                patch = previous.inputs_for(out.scheduled, inputs.sequences.query_start, self.device)
            if self.lora is not None:
                self.lora.prepare([s.request.lora for s in out.scheduled], inputs.sequences.query_lens, out.active_loras)
        return out, inputs, self.forward(inputs, patch)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The forward of one step's ``inputs`` (every rank of a tensor-parallel group runs it:
        rank 0 first sends the others ``inputs`` and ``patch``, the step message); ``patch``
        (async scheduling) puts tokens still on the device into ``input_ids``. Returns the logits
        ``[num_logits_rows, vocab]``."""
        if self.tp is not None and self.tp.rank == 0:
            with record_function("carpool.step_message"):  # on the host (a GPU's patch: copied back)
                self._command("forward", inputs, None if patch is None else tuple(t.cpu() for t in patch))
        elif patch is not None:
            patch = tuple(t.to(self.device) for t in patch)
        if self.tp is None:
            return self._forward(inputs, patch)
        try:
            return self._forward(inputs, patch)
        except BaseException:  # the ranks may now wait in different collectives: the group is done
            self.tp.broken = True
            raise

    def _forward(self, inputs: ModelInputs, patch: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        with record_function("carpool.prepare_inputs"):
            seqs = inputs.sequences
            arrays = [inputs.input_ids, inputs.positions, inputs.logits_indices]
            all_decodes = bool((seqs.query_lens == 1).all())
        if self.graphs is not None and all_decodes and len(inputs.sample_rows) == seqs.num_seqs and not inputs.prompt_spans:
            with record_function("carpool.forward"):
                n = seqs.num_seqs
                logits = self.graphs.run(
                    inputs.input_ids[:n], inputs.positions[:n], seqs.slot_mapping[:n], seqs.block_tables, seqs.seq_lens,
                    patch=patch,
                )
            if logits is not None:
                return logits
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
        pooling = capture_head_input(self.model) if inputs.pool_rows else contextlib.nullcontext()
        if decode_only:
            extra["carpool_decode"] = DecodeStep(*decode, block_size=self.block_size)
        if self.compiled:
            mark_step_dynamic(input_ids, positions, extra.get("carpool_decode"))
        with running_step(self.backend), record_function("carpool.forward"), pooling as captured:
            logits = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=logits_indices,
                **extra,
            ).logits[0]  # [num_logits_rows, vocab]
        if inputs.pool_rows:  # the final hidden states of the logits rows (replica.worker.pooler)
            inputs.head_input = captured[-1] if captured else None  # None: _pool fails those rows alone
        return logits

    def sample_later(self, launched: tuple[SchedulerOutput, ModelInputs, torch.Tensor]) -> PendingTokens:
        """:meth:`StepSampler.sample_later <replica.worker.step_sampler.StepSampler.sample_later>`
        of a launched step (:meth:`launch`)."""
        return self.step_sampler.sample_later(launched)
