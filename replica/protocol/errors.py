"""Errors a replica's engine raises to the callers of a request (torch-free, so that the HTTP
ingress can tell them apart without importing the engine)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the replica must be restarted."""


class RequestFailedError(RuntimeError):
    """The engine ended this request after an internal error (the engine itself serves on)."""


class RequestAbortedError(RuntimeError):
    """The server ended this request (e.g. it is shutting down); the client may retry elsewhere."""


class ReplicaOverloadedError(RuntimeError):
    """The replica already holds ``max_num_seqs + max_waiting_requests`` requests; this one was
    refused before anything was queued (the ingress answers 429 with ``Retry-After``)."""


class LatencyTargetError(ReplicaOverloadedError):
    """A request that asked to be shed rather than served late (``LatencyTargets.shed``) would
    miss its time-to-first-token target on this replica: it was refused before anything was
    queued (the ingress answers 429 with ``Retry-After``).

    Attributes:
        predicted_s: the replica's predicted TTFT (seconds); ``target_s``: the request's target.
    """

    def __init__(self, predicted_s: float, target_s: float) -> None:
        super().__init__(
            f"the predicted time to first token ({predicted_s:.2f} s) exceeds the request's target "
            f"({target_s:.2f} s, x-slo-ttft-ms) and the request asked to be shed (x-slo-shed)"
        )
        self.predicted_s = predicted_s
        self.target_s = target_s

    def __reduce__(self):  # crosses to the ingress by pickle, attributes included
        return (type(self), (self.predicted_s, self.target_s))


class LoRAAdapterError(ValueError):
    """A LoRA adapter cannot be used: its files are missing or not PEFT's LoRA format, its rank
    exceeds ``max_lora_rank``, its target modules or shapes do not fit the base model, its path is
    outside the allowed directories, or LoRA is not enabled (the ingress answers 400, naming the
    reason)."""


class RequestError(ValueError):
    """A request the model cannot run as given (:mod:`replica.protocol.request_checks`): a token
    id outside the vocabulary, a prompt too long for ``max_model_len``. The message starts with
    the field at fault; ``param`` names it and ``code`` is OpenAI's error code
    (``invalid_value``, ``context_length_exceeded``), so that the ingress answers the same 400
    whichever side found it."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):  # the replica's error crosses to the ingress by pickle, attributes included
        return (type(self), (str(self), self.param, self.code))
