"""Iteration-level scheduler: which requests run in the next step, and how many tokens each.

Plain Python, no torch. Continuous batching as in Orca (Yu et al. 2022, "Orca: A Distributed
Serving System for Transformer-Based Generative Models", OSDI '22) and vLLM v1's scheduler:

* one token budget per step (``max_num_batched_tokens``), spent on ``running`` requests first
  (1 token for a decode, a chunk for an unfinished prefill), then on ``waiting`` requests in FCFS
  order while seats (``max_num_seqs``) and KV blocks allow; prefills and decodes share one forward;
* a prompt larger than the remaining budget is prefilled in chunks (chunked prefill);
* when a running request needs a block and none is free, the newest running request is preempted
  by recompute: its blocks are freed, ``num_computed_tokens`` goes back to 0 and it goes first in
  ``waiting`` (its prompt *and* output so far are prefilled again when it is readmitted);
* a finished or aborted request gives back its seat and blocks in the step it finishes;
* with prefix caching, a request admitted without blocks starts from the longest cached prefix of
  its full blocks (``num_computed_tokens`` starts past it), and the blocks a step fills are
  registered in the cache when they are allocated (:meth:`Scheduler._allocate`);
* with async scheduling (vLLM v1's), step N+1 is scheduled while step N runs: :meth:`advance`
  counts step N's tokens as computed and its samples as pending (``Request.num_pending``), a
  running request then decodes its pending token next (``from_previous``), unless that token is
  sure to be its last (max_tokens, max_model_len); a stop the pending token brings (EOS, a stop
  string) is found one step late and that step's row for it is thrown away;
* ``scheduling_policy="priority"`` orders ``waiting`` and ``running`` by ``(priority, arrival)`` and
  lets a waiting request preempt running ones of lower priority (:mod:`replica.core.waiting_queue`).

:class:`Scheduler` is the ``"continuous"`` batching policy; another is a subclass that sets ``POLICY``
and overrides the hooks below (:mod:`replica.core.policies` builds the scheduler of a policy by name).
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from replica.core.block_manager import BlockManager
from replica.core.drafts import roll_back
from replica.core.lora_limit import LoRAAdmission, running_loras
from replica.core.prefix_lookup import first_chunk_start, register_full_blocks
from replica.core.request import Request, RequestStatus, check_stop
from replica.core.scheduler_output import ScheduledRequest, SchedulerOutput
from replica.core.waiting_queue import SCHEDULING_POLICIES, PriorityQueue, priority_victim, seat
from replica.protocol.outputs import FinishReason
from replica.protocol.request_checks import check_prompt_fits


class Scheduler:
    """Waiting and running queues over one :class:`BlockManager`: continuous batching.

    Args:
        block_manager: the KV block pool this scheduler allocates from.
        max_num_seqs: seats in the batch (running requests at most).
        max_num_batched_tokens: tokens computed per step at most (the token budget).
        max_model_len: prompt + output tokens per request at most.
        max_loras: LoRA: distinct adapters among running requests at most (a waiting request of
            another adapter is passed over until one of them has no running request); None: no LoRA.
        scheduling_policy: the waiting queue's order, ``"fcfs"`` or ``"priority"``
            (:mod:`replica.core.waiting_queue`). Raises ``ValueError`` for another.
    """

    POLICY: ClassVar[str] = "continuous"  # EngineConfig.batching_policy
    SUPPORTS_ASYNC_SCHEDULING: ClassVar[bool] = True  # may a step be scheduled before the last is read
    PREEMPTS_FOR_PRIORITY: ClassVar[bool] = True  # may a waiting request preempt running ones (priority policy)

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        max_loras: int | None = None, scheduling_policy: str = "fcfs",
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        self.scheduling_policy = scheduling_policy
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] | PriorityQueue = PriorityQueue() if scheduling_policy == "priority" else deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache (vLLM's counter)
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self._newly_cached: list[int] = []  # the current schedule()'s SchedulerOutput.newly_cached
        self._released: list[str] = []  # requests that left the running batch (see take_released)
        self._num_ending = 0  # async scheduling: running requests the step in flight ends for sure
        self._advanced: SchedulerOutput | None = None  # async: the step advanced and not yet read

    @property
    def batching_policy(self) -> str:
        """The batching policy (``EngineConfig.batching_policy``): this class's ``POLICY``."""
        return self.POLICY

    # ---- queue state -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Seats taken by requests still generating."""
        return len(self.running)

    @property
    def num_seats_taken(self) -> int:
        """Seats held, less those of requests the step in flight ends."""
        return len(self.running) - self._num_ending

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def take_released(self) -> list[str]:
        """Ids of the requests removed or preempted since the last call (their persistent-batch
        rows are free); the engine passes them to the model runner before each forward."""
        released, self._released = self._released, []
        return released

    # ---- adding and removing -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (in ``scheduling_policy``'s order). Raises ``ValueError`` on a duplicate
        id, ``RequestError`` on a prompt that can't fit (:func:`~replica.protocol.request_checks.check_prompt_fits`)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        scored_only = request.sampling_params.scores_prompt_only and not request.output_token_ids
        check_prompt_fits(request.num_tokens, self.max_model_len, scored_only)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None, step: int | None = None
    ) -> Request | None:
        """End a request now (abort, or a stop string found by the detokenizer in the token of
        ``step``; default: the latest step scheduled).

        Its seat and blocks are free when this returns (unless the policy keeps them: see
        :meth:`_release_finished`). Returns the request, or None if unknown or already finished.
        """
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, reason, stop_reason, step)
        return request

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None, step: int | None = None) -> None:
        """``step``: the step whose token ended the request (default: the latest scheduled)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.finish_step = step or self.step_count
        self._release_finished(request, reason)

    def _release_finished(self, request: Request, reason: FinishReason) -> None:
        """Hook: a request just finished (``reason``) gives back its seat and blocks, now."""
        if reason != FinishReason.ABORT:  # an abort may follow a failed step: nothing to trust
            self._cache_computed_blocks(request)
        self._remove(request)

    def _cache_computed_blocks(self, request: Request) -> None:
        """At a request's stop or length end, register its full blocks whose tokens are all known
        and whose K/V was computed by a step already read (not by the step in flight, whose
        failure would leave them half written). Async scheduling needs it: a block filled by a
        then-pending token waits for the next allocation (:meth:`_allocate`), and a request that
        ends gets none. The synchronous engine has registered them already, so both cache the
        same blocks."""
        bm = self.block_manager
        computed = request.num_computed_tokens
        if self._advanced is not None:
            computed -= sum(s.num_new_tokens for s in self._advanced.scheduled if s.request is request)
        self._register_full_blocks(request, min(computed, request.num_tokens, len(request.block_ids) * bm.block_size))

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.block_manager.free(request.request_id)
        request.block_ids = []
        self.requests.pop(request.request_id, None)
        self._released.append(request.request_id)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose the requests and token counts of the next step and allocate their blocks."""
        out = SchedulerOutput(step=self.step_count + 1)
        self._newly_cached = out.newly_cached
        if self.scheduling_policy == "priority" and self.PREEMPTS_FOR_PRIORITY:
            while (victim := priority_victim(self)) is not None:  # room for a waiting request of higher priority
                self._preempt(victim, out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == made_room:  # none preempted for blocks this step
            self._admit_waiting(out, budget, ahead_of=min((r.priority for r in out.preempted), default=None))
        if self.max_loras is not None:
            out.active_loras = running_loras(self.running)
        if out.scheduled:
            self.step_count += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Hook: the rows of running requests, oldest first, into ``out``; preempts the newest when
        blocks run out. Returns the budget left."""
        index = 0
        self._num_ending = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.is_finished:  # a seat the policy keeps after its request ended: no row here
                index += 1
                continue
            cached, start = first_chunk_start(self.block_manager, request)  # a request seated without blocks: its first chunk
            num_new = min(self._known_or_pending(request) - start, budget)
            if num_new <= 0:
                # Async: the step in flight computes its last token and ends it when it is read,
                # in this engine step: its seat (and persistent-batch row) go to a waiting request now.
                self._num_ending += 1
                self._released.append(request.request_id)
                index += 1
                continue
            target = start + num_new
            while not self.block_manager.can_allocate(request.request_id, target, cached or ()):
                victim = self._pick_victim(request)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank, index now points past it
            self._allocate(request, target, cached)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, ahead_of: int | None = None) -> None:
        """Hook: admit waiting requests into ``out``, in the queue's order, while seats, ``budget`` and blocks allow.
        Not called in a step that preempted a request for blocks (vLLM v1's rule: nothing is
        admitted then). In a step that preempted for priority, ``ahead_of`` is the victims' highest
        priority, and only requests of a priority above it (a smaller number) are admitted: the
        heads the victims made room for, in this same step, and never a victim back.
        A request whose adapter would exceed ``max_loras`` is passed over, keeping its place."""
        index = 0
        loras = LoRAAdmission(self.running, self.max_loras)
        while index < len(self.waiting) and budget > 0 and self.num_seats_taken < self.max_num_seqs:
            request = self.waiting[index]
            if ahead_of is not None and request.priority >= ahead_of:
                break  # the queue is in priority order: the rest wait for the next step
            if loras.blocked(request):
                index += 1
                continue
            cached, start = first_chunk_start(self.block_manager, request)
            num_new = min(request.num_tokens - start, budget)
            target = start + num_new
            if not self.block_manager.can_allocate(request.request_id, target, cached or ()):
                break
            del self.waiting[index]
            loras.admit(request)
            request.status = RequestStatus.RUNNING
            seat(self.running, request, self.scheduling_policy)
            self._allocate(request, target, cached)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _known_or_pending(self, request: Request) -> int:
        """Tokens of ``request`` a step may compute up to: the known ones, and the pending one of
        the step in flight (async scheduling) unless that token is sure to end the request."""
        if not request.num_pending:
            return request.num_tokens
        total = request.num_tokens + request.num_pending
        last = request.num_output_tokens + request.num_pending >= request.sampling_params.max_tokens
        return request.num_tokens if last or total >= self.max_model_len else total

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            start=start,
            num_new_tokens=num_new,
            # scores the prompt only: the prefill ends the request, nothing is sampled
            samples=start + num_new == self._known_or_pending(request) and not request.sampling_params.scores_prompt_only,
            from_previous=start >= request.num_tokens,
        )

    def _allocate(self, request: Request, num_tokens: int, cached: list[int] | None = None) -> None:
        """Grow ``request``'s blocks to ``num_tokens`` tokens, starting from the ``cached`` prefix
        blocks (None: no lookup was made), and register in the prefix cache the blocks that will be
        full once this step has computed them. Registering before the forward lets a later request
        of the same step share them: every attention backend writes a layer's new K/V before it
        reads any (vLLM registers at the same point)."""
        bm = self.block_manager
        if cached is not None:  # a lookup was made: vLLM's query and hit counts, in tokens
            hit = len(cached) * bm.block_size
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit
            request.num_computed_tokens = hit
            request.num_cached_blocks = len(cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit
        bm.allocate(request.request_id, num_tokens, cached or ())
        request.block_ids = bm.block_table(request.request_id)
        # A block is registered once its tokens are known: one filled with a pending token
        # (async scheduling) waits for a later step's allocation.
        self._register_full_blocks(request, min(num_tokens, request.num_tokens))

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """:func:`register_full_blocks`; they join the current step's ``newly_cached``."""
        self._newly_cached += register_full_blocks(self.block_manager, request, num_tokens)

    def _pick_victim(self, requester: Request) -> Request:
        """Hook: the request to preempt so that ``requester`` can grow: the last running request
        after ``requester`` that holds blocks (the newest; under the priority policy the lowest
        priority, newest: vLLM's choice), else the requester itself. Preempting one without blocks
        frees nothing; those after the requester are not scheduled in this step yet."""
        for request in reversed(self.running):
            if request is requester:
                break
            if request.block_ids:
                return request
        return requester

    def _free_blocks(self, request: Request) -> None:
        """Give back ``request``'s blocks; its cached blocks stay cached, for its return."""
        self.block_manager.free(request.request_id)
        request.block_ids = []
        request.num_cached_blocks = 0
        self._released.append(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Hook: preempt ``request`` by recompute (nothing computed; first in ``waiting``, or at its
        ``(priority, arrival)`` place under the priority policy)."""
        self._free_blocks(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # ---- after the forward -------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Async scheduling, right after :meth:`schedule`: count the step's tokens as computed and
        its samples as pending, so that the next step can be scheduled before this one's tokens
        are known (then :meth:`update_from_output` with ``advanced=True``)."""
        self._advanced = out
        for scheduled in out.scheduled:
            scheduled.request.num_computed_tokens += scheduled.num_new_tokens
            scheduled.request.num_pending += scheduled.samples

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int | None], *, advanced: bool = False,
        extra_token_ids: dict[int, list[int]] | None = None,
    ) -> list[Request]:
        """Advance ``num_computed_tokens`` (unless :meth:`advance` did), append sampled tokens and
        apply token-level stops.

        ``sampled_token_ids[i]`` is the token sampled for ``out.scheduled[i]`` (None where that
        row does not sample). Returns the requests that produced a token this step (or, with
        scoring their prompt only, finished their prefill), in order; those that finished have ``status ==
        FINISHED`` and their seat and blocks are already free (unless the policy keeps them:
        :meth:`_release_finished`). With ``advanced``, a request preempted since the step was
        scheduled still gets its token (it is recomputed with it). ``extra_token_ids[i]``
        (speculative decoding): the tokens row ``i`` emits after its first, one per accepted draft;
        each is checked for a stop in turn, and the rejected drafts are rolled back
        (:func:`replica.core.drafts.roll_back`).
        """
        produced: list[Request] = []
        self._num_ending = 0  # they end now
        if self._advanced is out:
            self._advanced = None  # read now
        for i, (scheduled, token_id) in enumerate(zip(out.scheduled, sampled_token_ids, strict=True)):
            request = scheduled.request
            if advanced and scheduled.samples:
                request.num_pending -= 1
            if request.status != RequestStatus.RUNNING and not (advanced and request.status == RequestStatus.WAITING):
                continue  # aborted while the step ran
            if not advanced:
                request.num_computed_tokens += scheduled.num_new_tokens
            if not scheduled.samples:
                # The prompt's last chunk (not num_computed_tokens: with ``advanced`` it may count a
                # later chunk still in flight).
                ends_prompt = scheduled.start + scheduled.num_new_tokens == request.num_tokens
                if request.sampling_params.scores_prompt_only and ends_prompt:
                    produced.append(request)  # the prompt is prefilled (and scored, or pooled): done, no token
                    # an embedding request ends as vLLM's pooling requests do: stopped
                    reason = FinishReason.STOP if request.pooling_params is not None else FinishReason.LENGTH
                    self._finish(request, reason, None, out.step)
                continue
            assert token_id is not None
            produced.append(request)
            extra = extra_token_ids.get(i, ()) if extra_token_ids else ()
            if scheduled.spec_token_ids:  # before a stop below caches the request's computed blocks
                roll_back(self, request, scheduled, len(extra))
            for token in (token_id, *extra):
                request.output_token_ids.append(token)
                reason, stop_reason = check_stop(request, token, self.max_model_len)
                if reason is not None:
                    self._finish(request, reason, stop_reason, out.step)
                    break
        return produced
