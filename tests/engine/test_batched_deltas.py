"""Batched deltas (``replica/serve/delta_channel.py``, ``router/dispatch/delta_receiver.py``): a replica's streamed
requests reach their ingress over one TCP connection, one frame per engine step.

A real ``LLMReplica`` (outside Serve, with the tiny Llama) and the ingress's real
``DeltaReceiver`` talk over 127.0.0.1, as ``router/dispatch/fanout.py`` drives them: open the request's
queue, call ``generate(request=<envelope>, announce=True, channel=key)``, connect to the address it announces,
watch the call's end, read the queue. Asserted: the tokens are those of the plain stream; several
requests' deltas share frames; an error and a cancellation reach the right request and leave every
KV block free; a connection that ends, or presents an unknown key, never leaves a reader waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

import pytest

import replica.serve.delta_channel as delta_channel
from replica import SamplingParams
from replica.protocol.envelope import RequestEnvelope, RoutingHints
from replica.protocol.outputs import EngineOutput
from replica.protocol.wire import HEADER, encode_frame
from replica.serve.delta_channel import DeltaChannels
from router.dispatch.delta_receiver import ConnectionLost, DeltaReceiver, on_call_end, queued_deltas
from tests.engine.test_failures import PROMPTS, make_replica, run
from tests.helpers import assert_idle

pytestmark = pytest.mark.timeout(120)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def envelope(rid: str, ids: list[int], params: SamplingParams) -> RequestEnvelope:
    """The request as the ingress sends it (``router/request/preparation.py``: ``Prepared.envelope``)."""
    return RequestEnvelope(rid, ids, params, RoutingHints.of(ids, 16))


async def plain_tokens(replica, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    """The request's tokens through the call's own stream (no channel)."""
    return [t async for d in replica.generate(request=envelope(rid, ids, params)) for t in d.new_token_ids]


async def start(replica, receiver: DeltaReceiver, rid: str, ids: list[int], params: SamplingParams):
    """What the ingress does for one streamed choice: returns ``(queue, call, watch)``."""
    queue = receiver.open(rid)
    call = replica.generate(request=envelope(rid, ids, params), announce=True, channel=receiver.key)
    address = await call.__anext__()
    await receiver.connect(address, rid)
    watch = asyncio.ensure_future(call.__anext__())
    watch.add_done_callback(functools.partial(on_call_end, queue))
    return queue, call, watch


async def batched(replica, receiver: DeltaReceiver, rid: str, ids: list[int], params: SamplingParams) -> list[EngineOutput]:
    queue, _, watch = await start(replica, receiver, rid, ids, params)
    try:
        return [d async for d in queued_deltas(queue, watch)]
    finally:
        receiver.close(rid)


@pytest.fixture(scope="module")
def replica(tiny_llama):
    r = make_replica(tiny_llama)
    yield r
    r.engine.shutdown()


def test_batched_deltas_give_each_request_its_own_tokens_and_share_frames(replica, monkeypatch):
    frames: list[int] = []

    def counting(items):
        frames.append(len(items))
        return encode_frame(items)

    monkeypatch.setattr(delta_channel, "encode_frame", counting)

    async def scenario():
        reference = [await plain_tokens(replica, f"plain-{i}", ids, greedy()) for i, ids in enumerate(PROMPTS[:3])]
        receiver = DeltaReceiver()
        outs = await asyncio.gather(*(batched(replica, receiver, f"b-{i}", ids, greedy()) for i, ids in enumerate(PROMPTS[:3])))
        receiver.shutdown()
        return reference, outs

    reference, outs = run(scenario())
    for ref, deltas in zip(reference, outs):
        assert [t for d in deltas for t in d.new_token_ids] == ref
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
    # 3 requests of 8 tokens: one frame per step carries all of them (a frame has >= 2 deltas).
    assert sum(frames) >= 3 and max(frames) >= 2 and len(frames) < sum(frames), frames
    assert_idle(replica.engine.engine)


def test_an_error_and_a_cancellation_reach_only_their_request(replica):
    async def scenario():
        receiver = DeltaReceiver()
        # The replica trusts the ingress's checks but its own max_model_len: a prompt that fills it.
        too_long = [1] * replica.engine.max_model_len
        bad = batched(replica, receiver, "bad", too_long, greedy())
        good = batched(replica, receiver, "good", PROMPTS[0], greedy())
        results = await asyncio.gather(bad, good, return_exceptions=True)
        # A long request cancelled after its first delta, as Serve cancels a call whose client left.
        queue, call, watch = await start(replica, receiver, "long", PROMPTS[1], greedy(max_tokens=100, ignore_eos=True))
        first = await queue.get()
        watch.cancel()  # Serve cancels the call's task: the replica aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        receiver.close("long")
        for _ in range(200):
            s = replica.engine.stats()
            if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        receiver.shutdown()
        return results, first

    (bad, good), first = run(scenario())
    assert isinstance(bad, ValueError) and "maximum context length" in str(bad), bad
    assert good[-1].finished and sum(len(d.new_token_ids) for d in good) == 8
    assert isinstance(first, EngineOutput) and not first.finished
    assert_idle(replica.engine.engine)
    assert replica._inflight == 0


def test_a_connection_with_an_unknown_key_is_closed_and_its_readers_told():
    async def scenario():
        channels = DeltaChannels("127.0.0.1")
        address = await channels.address()
        receiver = DeltaReceiver()  # its key names no channel there
        queue = receiver.open("r")
        await receiver.connect(address, "r")
        item = await asyncio.wait_for(queue.get(), 10)
        channels.close()
        return item

    assert isinstance(run(scenario()), ConnectionLost)


def test_deltas_wait_for_the_connection_then_arrive_in_order_and_merged():
    def delta(rid: str, token: int, finished: bool = False) -> EngineOutput:
        return EngineOutput(rid, [token], str(token), None, finished, "length" if finished else None, None, 3, token)

    async def scenario():
        channels = DeltaChannels("127.0.0.1")
        receiver = DeltaReceiver()
        queue = receiver.open("a")
        channel = channels.acquire(receiver.key, "a")
        channel.put("a", delta("a", 1))  # before the ingress connects: held
        channel.put("gone", delta("gone", 9))  # a request this ingress no longer knows: dropped
        await receiver.connect(await channels.address(), "a")
        channel.put("a", delta("a", 2))
        channel.put("a", delta("a", 3, finished=True))
        await asyncio.sleep(0.05)  # all three are queued: they come out as one delta
        deltas = [d async for d in queued_deltas(queue, None)]
        channels.release(channel, "a")
        # The replica side ends: a request still bound to the connection is told, not left waiting.
        other = receiver.open("b")
        await receiver.connect(await channels.address(), "b")
        channels.close()
        lost = await asyncio.wait_for(other.get(), 10)
        return deltas, lost

    deltas, lost = run(scenario())
    assert [d.new_token_ids for d in deltas] == [[1, 2, 3]] and deltas[0].finished
    assert isinstance(lost, ConnectionLost)


def test_a_failed_call_does_not_overtake_the_deltas_already_sent(monkeypatch):
    """A replica that dies right after its last delta: the call's error (through Ray) can come
    before that delta (through TCP). The request completes if its finished delta comes before the
    connection ends; otherwise the call's error (which allows a retry elsewhere) ends it, and no
    delta that came after the error is passed on."""
    import router.dispatch.delta_receiver as delta_receiver
    from router.dispatch.delta_receiver import CallEnded

    monkeypatch.setattr(delta_receiver, "CALL_END_GRACE_S", 0.2)
    died = RuntimeError("the replica died")

    def delta(token: int, finished: bool) -> EngineOutput:
        return EngineOutput("a", [token], str(token), None, finished, "length" if finished else None, None, 3, token)

    async def drain(queue: asyncio.Queue):
        got: list[EngineOutput] = []
        try:
            async for d in queued_deltas(queue, None):
                got.append(d)
        except BaseException as exc:  # noqa: BLE001 - the test asserts which
            return got, exc
        return got, None

    async def read(*items):
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        return await drain(queue)

    async def scenario():
        return (
            await read(delta(1, False), CallEnded(died), delta(2, False), delta(3, True), ConnectionLost("eof")),
            await read(delta(1, False), CallEnded(died), ConnectionLost("eof")),
            # Deltas after the error that do not finish the request are not sent: nothing of it
            # reached the client, so it may still start again on another replica.
            await read(CallEnded(died), delta(1, False), ConnectionLost("eof")),
            await read(CallEnded(died), delta(1, False)),  # no connection bound: the grace runs out
        )

    async def trickle():  # a replica still sending after its call failed: the grace is one deadline
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(CallEnded(died))

        async def send():
            for token in range(1, 100):
                await asyncio.sleep(0.05)
                queue.put_nowait(delta(token, False))

        sender = asyncio.ensure_future(send())
        started = asyncio.get_running_loop().time()
        try:
            got, error = await drain(queue)
        finally:
            sender.cancel()
        return got, error, asyncio.get_running_loop().time() - started

    completed, lost, unfinished, alone = run(scenario())
    got, error, waited = run(trickle())
    assert got == [] and error is died and waited < 1.0, (got, error, waited)
    assert [d.new_token_ids for d in completed[0]] == [[1], [2, 3]] and completed[0][-1].finished and completed[1] is None
    assert [d.new_token_ids for d in lost[0]] == [[1]] and lost[1] is died
    assert unfinished == ([], died)
    assert alone == ([], died)


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickling re-creates it with one argument: fails
        super().__init__(f"{a} {b}")


def test_an_item_that_does_not_pickle_costs_only_its_own_request():
    import pickle

    from replica.protocol.errors import RequestFailedError

    ok = EngineOutput("a", [5], "x", None, True, "length", None, 3, 1)
    frame = encode_frame([("a", ok), ("b", Unpicklable(1, 2))])
    items = pickle.loads(frame[HEADER.size :])
    assert items[0] == ("a", ok)
    assert items[1][0] == "b" and isinstance(items[1][1], RequestFailedError) and "Unpicklable" in str(items[1][1])


def test_a_lost_ingress_aborts_its_requests_and_a_late_connect_is_refused(monkeypatch):
    import router.dispatch.delta_receiver as delta_receiver

    monkeypatch.setattr(delta_receiver, "LAST_DELTA_GRACE_S", 0.2)

    async def scenario():
        lost: list[list[str]] = []
        channels = DeltaChannels("127.0.0.1", on_lost=lost.append)
        address = await channels.address()
        receiver = DeltaReceiver()
        channel = channels.acquire(receiver.key, "r1")
        queue = receiver.open("r1")
        late = receiver.open("r2")  # opened, its admission not yet processed
        await receiver.connect(address, "r1")
        receiver.shutdown()  # the ingress goes away: the replica aborts what it still runs for it
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        first = await asyncio.wait_for(queue.get(), 10)
        try:  # r2's deltas may have gone out on the connection that ended
            await receiver.connect(address, "r2")
            refused = None
        except ConnectionLost as exc:
            refused = exc
        # A call that ended normally whose last delta never comes does not wait forever.
        from router.dispatch.delta_receiver import CallEnded

        late.put_nowait(CallEnded(None))
        try:
            [d async for d in queued_deltas(late, None)]
            missing = None
        except ConnectionLost as exc:
            missing = exc
        channels.release(channel, "r1")
        channels.close()
        return lost, first, refused, missing

    lost, first, refused, missing = run(scenario())
    assert lost == [["r1"]]
    assert isinstance(first, ConnectionLost)
    assert isinstance(refused, ConnectionLost)
    assert isinstance(missing, ConnectionLost) and "did not arrive" in str(missing)
