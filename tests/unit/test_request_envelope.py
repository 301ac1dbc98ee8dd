"""The request contract from the ingress to the replica (issue 53): the ingress sends each choice
as one :class:`~replica.protocol.envelope.RequestEnvelope` by the keyword ``request``; the replica's
``generate``/``generate_all`` take it there; the request router finds it (and its routing hints)
through one lookup (``router/routing/pending.py``), which refuses a call of the old shape; and one
set of request rules (``replica/protocol/request_checks.py``) gives the same refusal on both sides.
No Ray cluster: a stand-in handle records the calls, and Serve's own ``PendingRequest`` wraps them.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from replica.protocol.envelope import ENVELOPE_KEYWORD, ROUTED_METHODS, RequestEnvelope, RoutingHints
from replica.protocol.errors import RequestError
from replica.protocol.lora_request import LoRARequest
from replica.protocol.prefix_hash import block_hashes
from replica.protocol.request_checks import ModelLimits, check_prompt_fits, check_request, check_vocabulary
from replica.protocol.sampling_params import SamplingParams
from replica.serve import LLMReplica
from router.dispatch.fanout import Fanout
from router.request.errors import replica_error, request_error
from router.request.preparation import Prepared
from router.routing.pending import MissingEnvelopeError, envelope_of, request_key
from tests.unit.test_policy import FakeReplica, make_router

SQL = LoRARequest("sql", 0, "/adapters/sql")
PROMPT = list(range(100, 120))  # 5 blocks of 4


def pending_of(method: str, args: tuple, kwargs: dict, request_id: str = "serve-1") -> PendingRequest:
    """Serve's pending request for a handle call ``method.remote(*args, **kwargs)``."""
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method=method)
    return PendingRequest(args=list(args), kwargs=dict(kwargs), metadata=metadata, future=None)


class RecordingHandle:
    """A ``DeploymentHandle`` stand-in: each ``<method>.remote(...)`` is recorded and answered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def options(self, **kw):
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, *args, **kwargs):
                handle.calls.append((method, args, kwargs))
                future = asyncio.get_running_loop().create_future()
                future.set_result("output")
                return _Response(future)

        return Method()


class _Response:
    def __init__(self, future) -> None:
        self.future = future

    def __await__(self):
        return self.future.__await__()

    def cancel(self) -> None:
        pass


def prepared(lora: LoRARequest | None = SQL) -> Prepared:
    p = Prepared("cmpl-x", "m", [PROMPT], [""], [[SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, seed=1)]], 4)
    p.lora_request = lora
    return p


def test_the_replica_takes_the_envelope_by_the_keyword_the_router_reads():
    for method in ROUTED_METHODS:
        parameters = inspect.signature(getattr(LLMReplica, method)).parameters
        assert ENVELOPE_KEYWORD in parameters, f"LLMReplica.{method} no longer takes {ENVELOPE_KEYWORD!r}"
        assert parameters[ENVELOPE_KEYWORD].kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
        )
        assert list(parameters)[1] == ENVELOPE_KEYWORD  # the request itself, first after self


def test_the_ingress_sends_envelopes_whose_hints_the_router_finds():
    """What the fan-out sends (non-streamed: generate_all) is what routing reads: the envelope by
    keyword, with the prompt's prefix hashes (chained from the adapter's root) and the adapter."""
    handle = RecordingHandle()
    fanout = Fanout(handle, view=None)
    outputs = asyncio.run(fanout.run_all(prepared()))
    assert outputs == ["output", "output"]
    assert [(m, a) for m, a, _ in handle.calls] == [("generate_all", ()), ("generate_all", ())]
    router = make_router([FakeReplica("a"), FakeReplica("b")])
    for i, (method, args, kwargs) in enumerate(handle.calls):
        request = pending_of(method, args, kwargs, f"serve-{i}")
        envelope = envelope_of(request)
        assert isinstance(envelope, RequestEnvelope) and envelope.request_id == f"cmpl-x-{i}"
        assert envelope.prompt_token_ids == PROMPT and envelope.lora_request == SQL
        assert envelope.routing.adapter == "sql"
        assert envelope.routing.prefix_hashes == tuple(block_hashes(PROMPT, 4, SQL.hash_root)) and len(envelope.routing.prefix_hashes) == 5
        assert router._prompt_hashes(request) == list(envelope.routing.prefix_hashes)
        holds, _ = router._adapter_places([FakeReplica("a")], request)
        assert holds is not None  # an adapter request
        assert request_key(request) == f"serve-{i}"
    # the n choices of one prompt share its hints (computed once)
    assert handle.calls[0][2][ENVELOPE_KEYWORD].routing is handle.calls[1][2][ENVELOPE_KEYWORD].routing


def test_a_base_model_request_has_no_adapter_hint():
    envelope = prepared(lora=None).envelope(0, 0, SamplingParams())
    assert envelope.routing.adapter is None and envelope.lora_request is None
    assert envelope.routing.prefix_hashes == tuple(block_hashes(PROMPT, 4))
    assert envelope.priority == 0 and envelope.slo is None


def test_routing_refuses_a_generate_call_without_its_envelope():
    envelope = prepared().envelope(0, 0, SamplingParams())
    old_shape = pending_of("generate", ("cmpl-x-0", PROMPT, SamplingParams(), True), {"lora_request": SQL})
    with pytest.raises(MissingEnvelopeError, match=r"generate call .* without its RequestEnvelope as the keyword 'request'"):
        envelope_of(old_shape)
    router = make_router([FakeReplica("a")])
    with pytest.raises(MissingEnvelopeError):
        asyncio.run(router.choose_replicas([FakeReplica("a")], old_shape))
    with pytest.raises(MissingEnvelopeError):  # the envelope positionally is no better
        envelope_of(pending_of("generate_all", (envelope,), {}))
    assert envelope_of(pending_of("generate", (), {ENVELOPE_KEYWORD: envelope})) is envelope
    assert envelope_of(pending_of("model_info", (), {})) is None  # other calls carry none
    assert envelope_of(None) is None


def test_one_rule_set_with_named_fields_and_codes():
    limits = ModelLimits(vocab_size=10, max_model_len=8)
    check_request([1, 2, 3], SamplingParams(), limits)
    cases = [
        (([1, 10], SamplingParams()), "prompt: token id 10 is outside the vocabulary [0, 10)", "prompt", "invalid_value"),
        (([1, -1], SamplingParams()), "prompt: token id -1 is outside", "prompt", "invalid_value"),
        (([1] * 8, SamplingParams()), "prompt: this model's maximum context length is 8 tokens; the prompt has 8 tokens", "prompt", "context_length_exceeded"),
        (([1] * 9, SamplingParams(max_tokens=0)), "prompt: this model's maximum context length is 8", "prompt", "context_length_exceeded"),
        (([1], SamplingParams(logit_bias={10: 1.0})), "logit_bias: token id 10 is outside the vocabulary [0, 10)", "logit_bias", "invalid_value"),
        (([1], SamplingParams(stop_token_ids=[12])), "stop_token_ids: token id 12 is outside", "stop_token_ids", "invalid_value"),
        (([], SamplingParams()), "prompt must be a non-empty list of token ids", "prompt", "invalid_value"),
        (([1], "greedy"), "sampling_params must be a SamplingParams", "sampling_params", "invalid_value"),
    ]
    for (ids, params), message, param, code in cases:
        with pytest.raises(RequestError) as info:
            check_request(ids, params, limits)
        assert str(info.value).startswith(message), (ids, str(info.value))
        assert (info.value.param, info.value.code) == (param, code)
    check_request([1] * 8, SamplingParams(max_tokens=0), limits)  # scoring a prompt of max_model_len tokens fits
    check_vocabulary(None, None, 10)


def test_scoring_the_prompt_only_is_one_named_mode():
    assert SamplingParams(max_tokens=0, prompt_logprobs=1).scores_prompt_only
    assert not SamplingParams(max_tokens=1).scores_prompt_only and not SamplingParams().scores_prompt_only
    check_prompt_fits(8, 8, True)
    with pytest.raises(RequestError):
        check_prompt_fits(8, 8, False)


def test_a_replicas_refusal_reaches_the_client_as_the_ingress_s_own():
    """A rule broken on the replica (its own max_model_len) crosses to the ingress by pickle and
    becomes the same 400 the ingress gives for it."""
    with pytest.raises(RequestError) as info:
        check_prompt_fits(9, 8, False)
    crossed = pickle.loads(pickle.dumps(info.value))
    assert (str(crossed), crossed.param, crossed.code) == (str(info.value), "prompt", "context_length_exceeded")
    for error in (replica_error(crossed), request_error(info.value)):
        assert (error.status_code, error.param, error.code) == (400, "prompt", "context_length_exceeded")
        assert error.message.startswith("prompt: this model's maximum context length is 8 tokens")
