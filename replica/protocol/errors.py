"""Errors a replica's engine raises to the callers of a request (torch-free, so that the HTTP
ingress can tell them apart without importing the engine)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the replica must be restarted."""


class RequestFailedError(RuntimeError):
    """The engine ended this request after an internal error (the engine itself serves on)."""


class RequestAbortedError(RuntimeError):
    """The server ended this request (e.g. it is shutting down); the client may retry elsewhere."""


class ReplicaOverloadedError(RuntimeError):
    """The replica already holds ``max_num_seqs + max_waiting_requests`` requests; this one was
    refused before anything was queued (the ingress answers 429 with ``Retry-After``)."""


class LoRAAdapterError(ValueError):
    """A LoRA adapter cannot be used: its files are missing or not PEFT's LoRA format, its rank
    exceeds ``max_lora_rank``, its target modules or shapes do not fit the base model, its path is
    outside the allowed directories, or LoRA is not enabled (the ingress answers 400, naming the
    reason)."""
