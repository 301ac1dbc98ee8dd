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
