"""The step-level engine: ``add_request``, ``abort``, ``step``.

One ``step()`` = schedule → one forward → sample → update → detokenize. Finished requests leave
their seat and free their blocks inside the step that finishes them; waiting requests take those
seats in the next step. Not thread-safe: ``replica.engine.async_engine`` drives it from one thread.

With ``async_scheduling`` one ``step()`` = schedule step N → launch its forward → read step N-1's
tokens, update, detokenize → sample step N and leave it in flight: a step's outputs come out of
the next ``step()`` call, and step N's decode rows take their input tokens from step N-1's device
tensor (see :meth:`LLMEngine._step_overlapped`). What the engine reports about itself (load,
settings, a record of each step for observers, the block check) is :mod:`replica.engine.reporting`'s,
mixed in; what a failed step does is :mod:`replica.engine.step_failures`'.
"""

from __future__ import annotations

import itertools
import logging
import time

from torch.profiler import record_function

from replica.config.engine_config import EngineConfig, deprecated_batching_name
from replica.config.model_files import load_tokenizer, resolve_gguf_model, resolve_model_path
from replica.core.block_manager import BlockManager
from replica.core.policies import make_scheduler
from replica.core.request import Request
from replica.core.scheduler_output import SchedulerOutput
from replica.engine.lora_support import EngineLoRA, EngineLoRAMethods, check_lora_request, runner_lora
from replica.engine.metrics import EngineMetrics
from replica.engine.output_processor import OutputProcessor
from replica.engine.request_builder import build_request, eos_token_ids
from replica.engine.reporting import EngineReporting
from replica.engine.step_failures import MAX_CONSECUTIVE_FAILED_STEPS, EngineStateError, fail_request, fail_step
from replica.protocol.outputs import EngineOutput, FinishReason
from replica.protocol.pooling_params import PoolingParams, check_dimensions, matryoshka_of
from replica.protocol.request_checks import check_priority
from replica.protocol.lora_request import LoRARequest
from replica.protocol.sampling_params import SamplingParams
from replica.sample.grammar import GrammarCompiler
from replica.spec_decode import make_speculator
from replica.worker.kv_sizing import decide_max_model_len
from replica.worker.model_runner import ModelRunner
from replica.worker.model_runner_output import InFlight, ModelRunnerOutput

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "EngineStateError", "MAX_CONSECUTIVE_FAILED_STEPS"]  # the latter two: step_failures'

class LLMEngine(EngineReporting, EngineLoRAMethods):
    """Continuous-batching engine over a paged KV cache for one transformers model.

    Args:
        config: an :class:`~replica.config.engine_config.EngineConfig` (or its fields as keyword arguments).
        metrics: where to record Prometheus metrics (none by default, e.g. offline use).
        launch_ranks: how a tensor-parallel engine starts its other ranks (``replica.worker.tp_launch``).

    Raises:
        ValueError: a setting this model cannot run (``max_model_len`` past the KV pool or its context).
    """

    def __init__(
        self, config: EngineConfig | None = None, *, metrics: EngineMetrics | None = None, launch_ranks=None, **kwargs
    ) -> None:
        self.config = config or EngineConfig(**kwargs)
        self.metrics = metrics
        cfg = self.config
        if cfg.quantization == "gguf":  # the folder converted from the file whose blocks it computes
            model_path, quantized_from = resolve_gguf_model(cfg.model)
        else:
            model_path, quantized_from = resolve_model_path(cfg.model), None
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path, cfg.tokenizer)
        self.runner = ModelRunner(
            model_path, dtype=cfg.dtype, device=cfg.device, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
            kv_cache_memory=cfg.kv_cache_memory, gpu_memory_utilization=cfg.gpu_memory_utilization,
            attention_backend=cfg.attention_backend, compile=cfg.compile, cuda_graphs=cfg.cuda_graphs,
            max_num_seqs=cfg.max_num_seqs, tensor_parallel_size=cfg.tensor_parallel_size, launch_ranks=launch_ranks,
            lora=runner_lora(cfg), gguf_file=str(quantized_from) if quantized_from else None,
            quantization=cfg.quantization,
        )
        try:
            self.max_model_len = decide_max_model_len(
                cfg.max_model_len, self.runner.shape, self.runner.num_blocks, cfg.block_size)
            self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching)
            self.lora = EngineLoRA(cfg, self.runner) if cfg.enable_lora else None
            self.scheduler = self._make_scheduler(cfg.batching_policy, cfg.scheduling_policy)
            self.vocab_size = self.runner.vocab_size
            self.runner.init_batch(cfg.max_num_seqs, self.max_model_len)
            self.warm_up_report = self.runner.warm_up(cfg.max_num_batched_tokens, cfg.max_num_seqs)
            self.speculator = make_speculator(cfg, self.runner, self.max_model_len)
            if self.speculator is not None:
                self.warm_up_report.update(self.speculator.seed_cost(self.runner, cfg.max_num_seqs, cfg.max_num_batched_tokens))
        except BaseException:  # a tensor-parallel runner's other ranks must not wait for it forever
            self.runner.close(kill=True)
            raise
        logger.info(
            "engine warm-up: %s",
            ", ".join(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}"
                      for key, value in self.warm_up_report.items()),
        )
        if self.runner.device.type == "cpu":
            from replica.kernels.cpu_kernels import dispatch_summary

            logger.info("CPU kernels: %s", dispatch_summary())
        self.eos_token_ids = eos_token_ids(self.runner.model, self.tokenizer)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.vocab_size, on_compile=metrics.on_grammar_compiled if metrics is not None else None
        )
        self.output_processor = OutputProcessor(self.tokenizer, metrics)
        self._ids = itertools.count()
        self._consecutive_failed_steps = 0
        self._in_flight: InFlight | None = None  # async scheduling: the step the next step() reads
        self._refresh_stats()

    # ---- requests ----------------------------------------------------------------------------
    def make_request(
        self, request_id: str | None = None, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
        lora_request: LoRARequest | None = None, priority: int = 0,
    ) -> Request:
        """Validate and build a :class:`Request` without touching engine state (thread-safe).
        With ``lora_request``, the request runs with that adapter (read from its folder the first
        time the engine sees it); ``priority``: vLLM's (lower runs first; not 0 only under the
        ``"priority"`` scheduling policy).

        Raises:
            ValueError: naming the field: ``prompt`` empty or of the wrong type, a token id
                outside the vocabulary, ``prompt`` too long for ``max_model_len``, bad
                ``sampling_params``, ``priority`` not an int or not 0 under ``"fcfs"``;
                ``LoRAAdapterError`` (a ``ValueError``): the adapter cannot be used, or LoRA is not enabled.
        """
        try:
            request = self._make_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time)
            request.priority = check_priority(priority, self.scheduler.scheduling_policy)
            request.lora = check_lora_request(self.lora, lora_request)
            return request
        except ValueError:
            if self.metrics is not None:
                self.metrics.on_rejected()
            raise

    def _make_request(self, request_id, prompt, prompt_token_ids, sampling_params, arrival_time) -> Request:
        return build_request(
            str(request_id) if request_id is not None else f"req-{next(self._ids)}",
            prompt, prompt_token_ids, sampling_params, arrival_time,
            tokenizer=self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids, grammar_compiler=self.grammar_compiler,
        )

    def check_pooling(self, params: PoolingParams | None) -> None:
        """An embedding request's pooling parameters (None: a generation request, always fine)
        are ones this model can give: ``dimensions`` only on a Matryoshka model
        (:func:`~replica.protocol.pooling_params.check_dimensions`). Raises ``RequestError``."""
        if params is not None:
            check_dimensions(params, *self.embedding_size())

    def embedding_size(self) -> tuple[int, list[int] | bool | None]:
        """``(hidden size, Matryoshka sizes)`` of this model's embeddings (:func:`matryoshka_of`)."""
        config = self.runner.hf_config
        return config.get_text_config().hidden_size, matryoshka_of(config)

    def add_request(
        self, request_id: str | None = None, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
        lora_request: LoRARequest | None = None, priority: int = 0,
    ) -> Request:
        """Validate (see :meth:`make_request`) and queue a request; returns it."""
        request = self.make_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time, lora_request, priority)
        self.add_prepared_request(request)
        return request

    def add_prepared_request(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request`. Raises ``ValueError`` on a duplicate id.

        The detokenizer is built first, so a failure leaves nothing half-added.
        """
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        detokenizer = self.output_processor.detokenizer_for(request)
        self.scheduler.add_request(request)
        self.output_processor.track(request.request_id, detokenizer)
        self._refresh_stats()

    def abort(self, request_id: str) -> EngineOutput | None:
        """Abort a waiting or running request; its seat and blocks are free on return.

        Returns its final output (``finish_reason="abort"``), or None if it is unknown or done.
        """
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        if request is None:
            return None
        output = self.output_processor.final_output(request)
        self._refresh_stats()
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _forget_released(self) -> None:
        """Rows (and a speculator's state) of the requests that left the running batch."""
        for request_id in self.scheduler.take_released():
            self.runner.forget(request_id)
            if self.speculator is not None:
                self.speculator.forget(request_id)

    def _make_scheduler(self, batching: str, scheduling: str):
        cfg = self.config
        return make_scheduler(batching, self.block_manager, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len,
                              max_loras=cfg.max_loras if cfg.enable_lora else None, scheduling_policy=scheduling)

    def set_batching_policy(self, policy: str) -> None:
        """Batch with ``policy`` (``"continuous"`` or ``"static"``; benchmarks run each in turn on one
        engine), keeping the scheduling policy: a new scheduler over the same KV blocks, its counters
        at 0. Raises ``RuntimeError`` unless the engine is idle, ``ValueError`` for an unknown policy."""
        self._replace_scheduler(policy, self.scheduler.scheduling_policy)

    def set_scheduling_policy(self, policy: str) -> None:
        """Order the waiting queue by ``policy`` (``"fcfs"`` or ``"priority"``), keeping the batching
        policy; raises as :meth:`set_batching_policy`. ``"continuous"`` and ``"static"``, its former
        values, still set the batching policy, with a ``FutureWarning``."""
        if deprecated_batching_name(policy, "LLMEngine.set_scheduling_policy"):
            self.set_batching_policy(policy)
        else:
            self._replace_scheduler(self.scheduler.batching_policy, policy)

    def _replace_scheduler(self, batching: str, scheduling: str) -> None:
        if self.has_unfinished_requests() or self._in_flight is not None:
            raise RuntimeError("the scheduling policy changes only on an idle engine")
        scheduler = self._make_scheduler(batching, scheduling)
        self._forget_released()
        self.scheduler = scheduler
        self._refresh_stats()

    @property
    def async_scheduling(self) -> bool:
        """Whether steps overlap (``EngineConfig.async_scheduling``; None: on CUDA only), where the
        scheduler's policy allows it: the static baseline (which benchmarks may switch to on an
        idle engine) always runs synchronously."""
        wanted = self.config.async_scheduling
        if wanted is None:
            wanted = self.runner.device.type == "cuda"
        return wanted and self.scheduler.SUPPORTS_ASYNC_SCHEDULING and self.speculator is None

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Run one iteration; return a delta for every request that produced a token or failed.

        Failures are contained (see the module docstring):

        * an error that belongs to one request (sampling its row alone, detokenizing, stop
          handling) ends that request alone: its seat and blocks are freed and its output has
          ``finish_reason="abort"`` and ``error`` set; the step's other requests go on;
        * an error in the batched forward ends every request of this step the same way (their
          KV blocks may hold half-written entries), and the engine keeps serving the rest.

        Raises:
            EngineStateError: the engine state cannot be trusted any more (the scheduler failed,
                the block accounting no longer adds up after a failure, or
                ``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row failed). The caller must stop
                using this engine.
        """
        started = time.monotonic()
        scheduler = self.scheduler
        queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        try:
            with record_function("carpool.schedule"):
                out = scheduler.schedule()
        except Exception as exc:
            raise EngineStateError(f"the scheduler failed: {exc!r}") from exc
        if self.metrics is not None:
            self.metrics.on_prefix_cache(
                queries=scheduler.prefix_cache_queries - queries, hits=scheduler.prefix_cache_hits - hits
            )
        self._forget_released()
        seats_taken = self.scheduler.num_seats_taken  # during this step, before finishes free seats
        for sched in out.scheduled:
            request = sched.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = started
                if self.metrics is not None:
                    self.metrics.on_first_scheduled(started - request.arrival_time, request.priority)
        if self.metrics is not None and out.preempted:  # also in a step that then schedules nothing
            self.metrics.on_preempted([r.priority for r in out.preempted])
        if self.async_scheduling:
            outputs = self._step_overlapped(out)
        elif out.is_empty:
            if not out.preempted:
                return []
            outputs = []  # nothing ran, but it preempted: counted above, its stats and record below
        else:
            try:
                if self.speculator is not None:
                    with record_function("carpool.propose_drafts"):
                        self.speculator.prepare(self.scheduler, out)
                result = self.runner.execute(out)
            except Exception as exc:
                outputs = fail_step(self, out, exc)
                self._notify_step(out, started)
                return outputs
            self._consecutive_failed_steps = 0
            outputs = self._process(out, result)
            if self.speculator is not None:
                counts = self.speculator.observe(out, result.extra_token_ids, time.monotonic() - started)
                if counts is not None and self.metrics is not None:
                    self.metrics.on_spec_decode(**counts)
        if self.metrics is not None and not out.is_empty:
            self.metrics.on_step(
                num_tokens=out.num_batched_tokens,
                num_running=seats_taken,
                num_slots=self.scheduler.max_num_seqs,
                duration_s=time.monotonic() - started,
            )
        self._refresh_stats(None if out.is_empty else time.monotonic() - started)
        self._notify_step(out, started)
        return outputs

    def _step_overlapped(self, out: SchedulerOutput) -> list[EngineOutput]:
        """Async scheduling: launch the forward of ``out`` (just scheduled), then finish the step
        in flight (its tokens, stops, detokenizing) while that forward runs, then sample ``out``
        and leave it in flight. On CUDA the host work of both ends overlaps the device's work;
        on CPU, where every op is synchronous, the same order runs without overlap."""
        previous, self._in_flight = self._in_flight, None
        launched = failed = None
        if not out.is_empty:
            self.scheduler.advance(out)
            try:
                launched = self.runner.launch(out, previous.tokens if previous is not None else None)
            except Exception as exc:
                failed = exc
        outputs = []
        if previous is not None:
            prev_out, pending = previous
            try:
                result = pending.result()
            except Exception as exc:
                outputs += fail_step(self, prev_out, exc)
            else:
                outputs += self._process(prev_out, result, advanced=True)
        if launched is not None:
            try:
                self._in_flight = InFlight(out, self.runner.sample_later(launched))
            except Exception as exc:
                failed = exc
        if failed is not None:
            return outputs + fail_step(self, out, failed)
        if launched is not None:
            self._consecutive_failed_steps = 0
        return outputs

    def _process(self, out: SchedulerOutput, result: ModelRunnerOutput, *, advanced: bool = False) -> list[EngineOutput]:
        """Outputs of a step whose forward and sampling are done: failed rows end, tokens are
        appended (``advanced``: see :meth:`Scheduler.update_from_output`), stops applied, text
        detokenized."""
        outputs = []
        for row, exc in result.errors.items():  # rows whose sampling failed: end them before the update
            request = out.scheduled[row].request
            if request.is_finished:
                continue
            outputs.append(fail_request(self, request, exc))
        for row, entries in result.prompt_logprobs.items():
            out.scheduled[row].request.prompt_logprobs.extend(entries)
        for row, vector in result.embeddings.items():  # embedding requests: their prefill ends them below
            out.scheduled[row].request.embedding = vector
        logprobs_of = {  # a row's logprobs entries: its first token's, then (speculation) the others'
            id(s.request): [lp, *result.extra_logprobs.get(i, ())]
            for i, (s, lp) in enumerate(zip(out.scheduled, result.logprobs)) if lp is not None
        }
        with record_function("carpool.update"):
            produced = self.scheduler.update_from_output(
                out, result.sampled_token_ids, advanced=advanced, extra_token_ids=result.extra_token_ids
            )
        now = time.monotonic()
        with record_function("carpool.detokenize"):
            for request in produced:
                try:
                    outputs.append(self.output_processor.token_output(
                        request, now, logprobs_of.get(id(request)), out.step, self._finish_on_stop_string
                    ))
                except Exception as exc:
                    outputs.append(fail_request(self, request, exc))
        return outputs

    def _finish_on_stop_string(self, request_id: str, stop_string: str, step: int) -> None:
        self.scheduler.finish_request(request_id, FinishReason.STOP, stop_string, step)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (vLLM's ``reset_prefix_cache``), e.g. between
        benchmark runs; returns how many were dropped."""
        dropped = self.block_manager.reset_prefix_cache()
        self._refresh_stats()
        return dropped

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica (nothing at TP 1; idempotent)."""
        self.runner.close()
