"""What the engine does when a step or a request fails (:class:`~replica.engine.llm_engine.LLMEngine`'s
contained failures): the request, or every request of the step, ends with an error output; the
engine state is checked, and :class:`EngineStateError` says when it can no longer be trusted."""

from __future__ import annotations

import logging

from replica.core.request import Request
from replica.core.scheduler_output import SchedulerOutput
from replica.protocol.outputs import EngineOutput, FinishReason

logger = logging.getLogger("replica.engine.llm_engine")

# A forward that fails this many times in a row means the device or model is broken, not one batch.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineStateError(RuntimeError):
    """The engine's state can no longer be trusted; the engine must be replaced."""


def fail_request(engine, request: Request, exc: BaseException) -> EngineOutput:
    """End ``request`` after an internal error: seat and blocks freed, an output with ``error``."""
    logger.error("request %s failed: %r", request.request_id, exc, exc_info=exc)
    if engine.scheduler.requests.get(request.request_id) is request and not request.is_finished:
        engine.scheduler.finish_request(request.request_id, FinishReason.ABORT)
    else:  # finished in this step already (its blocks are free); report the error instead
        request.finish_reason, request.stop_reason = FinishReason.ABORT, None
    return engine.output_processor.final_output(request, exc)


def fail_step(engine, out: SchedulerOutput, exc: BaseException) -> list[EngineOutput]:
    """The forward of ``out`` failed: end every request it scheduled, then check the state."""
    engine._consecutive_failed_steps += 1
    logger.error(
        "engine step %d failed (%d in a row); ending its %d requests",
        out.step, engine._consecutive_failed_steps, len(out.scheduled), exc_info=exc,
    )
    outputs = []
    seen: set[str] = set()
    # Blocks registered for this step to fill may be half written: out of the cache. Only
    # this step's requests hold them; blocks registered earlier were computed by earlier steps.
    engine.block_manager.uncache(out.newly_cached)
    for sched in out.scheduled:
        request = sched.request
        if sched.is_padding or request.request_id in seen or request.is_finished:
            continue  # a padding row (static baseline), or (async) a request that ended meanwhile
        seen.add(request.request_id)
        outputs.append(fail_request(engine, request, exc))
    engine._refresh_stats()
    try:
        engine.check_integrity()
    except AssertionError as broken:
        raise EngineStateError(f"KV block accounting broken after a failed step: {broken}") from exc
    if engine.runner.group_broken:  # a rank died or a collective failed: every later step would fail
        raise EngineStateError(f"the tensor-parallel group is broken; last error: {exc!r}") from exc
    if engine._consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
        raise EngineStateError(
            f"{engine._consecutive_failed_steps} engine steps in a row failed; last error: {exc!r}"
        ) from exc
    return outputs
