"""Static batching, the baseline that continuous batching is compared with (``batching_policy="static"``).

Plain Python, no torch. A batch is admitted only when the previous one has wholly finished, and a
finished member keeps its seat, its blocks and its row in the forward (as padding, like a padded
static batch) until the last member ends. The batch is fixed when it forms: members whose prefill
does not fit that step's token budget still take a seat and are prefilled in the following steps.

A finished member is marked ``Request.is_padding``; its row (``ScheduledRequest.is_padding``)
recomputes its last token at the next position and its sample is thrown away (the model runner
computes the row like any other). The engine runs this policy synchronously: a step is read before
the next one is scheduled.
"""

from __future__ import annotations

from replica.core.lora_limit import LoRAAdmission
from replica.core.request import Request, RequestStatus
from replica.core.scheduler import Scheduler
from replica.core.scheduler_output import ScheduledRequest, SchedulerOutput
from replica.core.waiting_queue import seat
from replica.protocol.outputs import FinishReason


class StaticBatchScheduler(Scheduler):
    """:class:`~replica.core.scheduler.Scheduler` with the static baseline's admission, finishing
    and padding rows (same arguments)."""

    POLICY = "static"
    SUPPORTS_ASYNC_SCHEDULING = False  # padding rows and the batch's release assume synchronous steps
    PREEMPTS_FOR_PRIORITY = False  # a batch is fixed when it forms: priority orders the queue only

    # ---- queue state -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Seats taken by requests still generating (padding rows not counted)."""
        return sum(1 for r in self.running if not r.is_padding)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or any(not r.is_padding for r in self.running)

    # ---- finishing ---------------------------------------------------------------------------
    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None, step: int | None = None
    ) -> Request | None:
        """As :meth:`Scheduler.finish_request`; a non-aborted member stays as padding until its
        batch ends, and the batch leaves when this ends its last unfinished member."""
        request = super().finish_request(request_id, reason, stop_reason, step)
        if request is not None:
            self._release_batch_if_done()
        return request

    def _release_finished(self, request: Request, reason: FinishReason) -> None:
        if reason != FinishReason.ABORT and request in self.running:
            request.is_padding = True  # keeps its seat and blocks until the batch ends
        else:
            super()._release_finished(request, reason)

    def _release_batch_if_done(self) -> None:
        if self.running and all(r.is_padding for r in self.running):
            for request in list(self.running):
                self._remove(request)

    # ---- one step ----------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """The running members' rows, then the finished members' rows (padding) while room is left:
        after the real requests, so that a preemption never frees a scheduled row."""
        budget = super()._schedule_running(out, budget)
        for request in self.running:
            if request.is_padding and budget > 0:
                scheduled = self._schedule_padding(request)
                if scheduled is not None:
                    out.scheduled.append(scheduled)
                    budget -= 1
        return budget

    def _schedule_padding(self, request: Request) -> ScheduledRequest | None:
        """A finished member's row: recompute at the next position, if it fits."""
        position = request.num_computed_tokens
        if position >= self.max_model_len or not self.block_manager.can_allocate(
            request.request_id, position + 1
        ):
            return None  # out of room: the padding row stops being computed, keeps its seat
        self.block_manager.allocate(request.request_id, position + 1)  # padding K/V: never cached
        request.block_ids = self.block_manager.block_table(request.request_id)
        return ScheduledRequest(request, position, 1, samples=True, is_padding=True)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, ahead_of: int | None = None) -> None:
        """A new batch forms only once the previous one has left (``running`` is as the step found
        it); its members whose prefill did not fit the budget this step still take a seat. Static
        batching never preempts for priority, so ``ahead_of`` is always None here."""
        if self.running:
            return
        super()._admit_waiting(out, budget, ahead_of)
        loras = LoRAAdmission(self.running, self.max_loras)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if loras.blocked(request) or not self.block_manager.can_allocate(request.request_id, request.num_tokens):
                break
            self.waiting.popleft()
            loras.admit(request)
            request.status = RequestStatus.RUNNING
            seat(self.running, request, self.scheduling_policy)

    def _pick_victim(self, requester: Request) -> Request:
        """Padding rows that hold blocks go first (they are scheduled after every real request)."""
        for request in reversed(self.running):
            if request.is_padding and request.block_ids:
                return request
        return super()._pick_victim(requester)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """A padding row gives back its blocks and is never computed again; it keeps its seat."""
        if not request.is_padding:
            super()._preempt(request, out)
            return
        self._free_blocks(request)
        request.num_computed_tokens = self.max_model_len

    # ---- after the forward -------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int | None], *, advanced: bool = False,
        extra_token_ids: dict[int, list[int]] | None = None,
    ) -> list[Request]:
        """As :meth:`Scheduler.update_from_output`; a padding row's position counts as computed and
        its sample is thrown away, and the batch leaves when its last member has finished."""
        for scheduled in out.scheduled:
            if scheduled.is_padding:
                scheduled.request.num_computed_tokens += 1
        produced = super().update_from_output(out, sampled_token_ids, advanced=advanced, extra_token_ids=extra_token_ids)
        self._release_batch_if_done()
        return produced
