"""How the ingress answers each way a replica request can fail (``router.request.errors.replica_error``).

The exceptions are the real ones, as they reach the ingress: the replica's own exception wrapped
by Ray (``RayTaskError``, which keeps it as ``cause`` and is an instance of its class), or Ray's
own error when the replica process is gone.
"""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from replica.protocol.errors import EngineDeadError, LoRAAdapterError, RequestAbortedError, RequestFailedError
from router.request.errors import replica_error as _replica_error


def from_replica(exc: BaseException) -> BaseException:
    """``exc`` as Ray delivers an exception raised inside a replica method."""
    return RayTaskError("generate", "Traceback: ...", exc).as_instanceof_cause()


@pytest.mark.parametrize("wrap", [lambda e: e, from_replica])
def test_engine_errors_map_to_500_and_503_with_their_message(wrap):
    failed = _replica_error(wrap(RequestFailedError("internal error while generating: TypeError: boom")))
    assert failed.status_code == 500 and failed.body()["error"]["code"] == "internal_error"
    assert "TypeError: boom" in failed.message

    ended = _replica_error(wrap(RequestAbortedError("the server is shutting down")))
    assert ended.status_code == 503 and ended.message == "the server is shutting down"
    assert ended.body()["error"]["type"] == "service_unavailable_error"

    dead = _replica_error(wrap(EngineDeadError("engine loop died: IndexError()")))
    assert dead.status_code == 503 and "engine loop died" in dead.message


def test_a_dead_replica_process_is_a_503_and_bad_input_a_400():
    gone = _replica_error(ActorDiedError())
    assert gone.status_code == 503 and "ActorDiedError" in gone.message
    assert gone.body()["error"]["code"] == "unavailable"

    bad = _replica_error(from_replica(ValueError("top_k must be -1, 0 or positive, got -5")))
    assert bad.status_code == 400 and bad.body()["error"]["param"] == "top_k"


@pytest.mark.parametrize("wrap", [lambda e: e, from_replica])
def test_an_unusable_lora_adapter_is_a_400_naming_the_reason(wrap):
    bad = _replica_error(wrap(LoRAAdapterError("adapter 'sql': rank 32 of 'q_proj' exceeds max_lora_rank=16")))
    assert bad.status_code == 400 and bad.message == "adapter 'sql': rank 32 of 'q_proj' exceeds max_lora_rank=16"
    assert bad.body()["error"]["code"] == "invalid_lora_adapter" and bad.param == "model"


@pytest.mark.parametrize(
    "message, param",
    [
        ("structured_outputs.choice: the constraint does not compile: NoExtensionBias", "structured_outputs.choice"),
        ("max_tokens must be at least 0", "max_tokens"),
        ("structured_outputs.json is not valid JSON: Expecting value", "structured_outputs.json"),
        ("guided_regex: the constraint does not compile: no output satisfies it", "guided_regex"),
        ("tools.0.function.parameters: the constraint does not compile", "tools.0.function.parameters"),
        ("3 tokens past the context", None),
        (": nothing", None),
        ("request_id 'x-0' is already in use", None),
        ("prompt_token_ids must be a list", None),
    ],
)
def test_a_refusal_names_the_field_its_message_starts_with(message, param):
    bad = _replica_error(from_replica(ValueError(message)))
    assert bad.status_code == 400 and bad.param == param and bad.message == message
