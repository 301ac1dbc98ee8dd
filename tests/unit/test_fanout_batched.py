"""``router.dispatch.fanout.Fanout`` with batched deltas when a replica's announced address cannot be
reached (it died between its admission and the ingress's connect, or the network refuses the
port): the choice starts again once, through a Ray stream, and after ``MAX_UNREACHABLE`` such
failures in a row the ingress stops trying the connections.

The handle is a stand-in that records calls (no Ray here); the address is a real closed port of
127.0.0.1, so the connection really fails.
"""

from __future__ import annotations

import asyncio
import socket

import router.dispatch.fanout as fanout
from replica.protocol.envelope import RequestEnvelope, RoutingHints
from replica.protocol.sampling_params import SamplingParams
from router.dispatch.delta_receiver import DeltaReceiver
from router.dispatch.fanout import MAX_UNREACHABLE, Fanout


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Call:
    """A streamed call: its first item is the admission (an address with batched deltas, else None)."""

    def __init__(self, first) -> None:
        self.first = first
        self.cancelled = False

    async def __anext__(self):
        return self.first

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, Call]] = []
        self.generate = self

    def options(self, **kw):
        return self

    def remote(self, **kwargs):  # generate(request=envelope, announce=..., channel=...): keywords only
        batched = kwargs["channel"] is not None
        call = Call(("127.0.0.1", closed_port()) if batched else None)
        self.calls.append((kwargs, call))
        return call


class Prepared:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def jobs(self):
        yield 0, 0, [1, 2, 3], SamplingParams(max_tokens=4)

    def envelope(self, index, prompt_index, params):
        return RequestEnvelope(f"{self.request_id}-{index}", [1, 2, 3], params, RoutingHints.of([1, 2, 3], 16))


def test_an_unreachable_replica_address_starts_the_choice_again_through_ray(monkeypatch):
    monkeypatch.setattr(fanout, "unavailable", lambda view: False)  # some replica can serve

    class View:
        async def current(self):
            return None

    async def scenario():
        handle = Handle()
        f = Fanout(handle, View(), DeltaReceiver())
        streams = await f.open_streams(Prepared("cmpl-1"))
        first = (list(handle.calls), f.receiver is not None, streams[0].request_id, streams[0].queue)
        for i in range(2, MAX_UNREACHABLE + 1):
            await f.open_streams(Prepared(f"cmpl-{i}"))
        return first, handle.calls, f.receiver

    (calls, still_batched, request_id, queue), all_calls, receiver = asyncio.run(asyncio.wait_for(scenario(), 60))
    (kwargs1, call1), (kwargs2, call2) = calls
    assert kwargs1["channel"] is not None and call1.cancelled  # batched, then given up
    assert kwargs1["request"].request_id == "cmpl-1-0" and kwargs1["announce"]
    assert kwargs2["channel"] is None and kwargs2["request"].request_id == "cmpl-1-0-retry"  # started again through Ray
    assert request_id == "cmpl-1-0-retry" and queue is None
    assert still_batched  # one unreachable address does not turn batched deltas off
    assert len(all_calls) == 2 * MAX_UNREACHABLE and receiver is None  # MAX_UNREACHABLE in a row do
