"""A hand-driven scheduler for the scheduler tests: requests with made-up prompts, one ``step``
(``schedule()`` then ``update_from_output``, as the engine does around its forward) and views of a
step's rows.

Pure Python, no torch. Sampled tokens are made up: FILLER (never EOS, never a stop id the tests
use) unless a test gives one.
"""

from __future__ import annotations

from replica.core.block_manager import BlockManager
from replica.core.policies import make_scheduler as new_scheduler
from replica.core.request import Request
from replica.core.scheduler import Scheduler
from replica.core.scheduler_output import SchedulerOutput
from replica.protocol.sampling_params import SamplingParams

EOS = 2
FILLER = 1000  # made-up sampled token: never EOS, never a stop id used below


def req(
    rid: str, prompt_len: int, max_tokens: int = 1000, *, ignore_eos: bool = False, priority: int = 0, **params
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[10 + i for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params),
        eos_token_ids=(EOS,),
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "continuous",
    scheduling: str = "fcfs",
) -> Scheduler:
    """A scheduler of batching ``policy`` whose waiting queue is in ``scheduling``'s order."""
    return new_scheduler(
        policy,
        BlockManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        scheduling_policy=scheduling,
    )


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One schedule + update; a sampling row gets ``tokens[rid]`` or FILLER."""
    out = sched.schedule()
    sampled = [
        (tokens or {}).get(s.request.request_id, FILLER) if s.samples else None for s in out.scheduled
    ]
    sched.update_from_output(out, sampled)
    return out


def rows(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens computed this step) per scheduled row, in the step's order."""
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def detail(out: SchedulerOutput) -> list[tuple[str, int, int, bool, bool]]:
    return [(s.request.request_id, s.start, s.num_new_tokens, s.samples, s.is_padding) for s in out.scheduled]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def assert_blocks_consistent(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_integrity()
    for r in list(sched.running) + list(sched.waiting):
        assert r.block_ids == bm.block_table(r.request_id), r.request_id
    live = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    assert set(bm.owners()) <= live
