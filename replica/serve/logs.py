"""Where Carpool's own log lines go. Python drops INFO records of a logger nobody configured
(its last-resort handler prints WARNING and above), so the replica's ``ready: model=... dtype=...``
line and the app's ``deploying N replica(s)`` never showed. These two functions send Carpool's
loggers (``cluster``, ``replica``, ``router``) somewhere in its own processes: the console at
INFO in the CLIs, Serve's logger at its level in Serve replicas; other libraries' loggers keep
their levels. Library use (``replica.LLM`` in a script) calls neither, so there the
application's own logging setup decides.
"""

from __future__ import annotations

import logging
import sys

from replica.protocol.errors import ReplicaOverloadedError

CARPOOL_LOGGERS = ("cluster", "replica", "router")
SERVE_LOGGER = "ray.serve"  # ray.serve._private.constants.SERVE_LOGGER_NAME


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (as Python's last-resort handler does),
    not the stream of the moment it was made, which a test runner may have closed since."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _ToServe(logging.Handler):
    """Hands each record to Serve's ``ray.serve`` logger as it is at that moment: its level and
    handlers follow the deployment's ``logging_config``, also after Serve reconfigures a running
    replica."""

    def emit(self, record: logging.LogRecord) -> None:
        serve_logger = logging.getLogger(SERVE_LOGGER)
        if record.levelno >= serve_logger.getEffectiveLevel():
            serve_logger.handle(record)


class _RefusalsInOneLine(logging.Filter):
    """Serve logs every exception a replica's method raises as ``Request failed.`` at ERROR with
    its traceback. In the engine's replica, two are refusals, not failures: a full replica
    (``ReplicaOverloadedError``, the client gets a 429) and a request the engine refuses
    (``ValueError``, a 400: ``LLMReplica.generate``'s contract, e.g. a constraint that does not
    compile for the vocabulary). Those records become one WARNING line naming the exception,
    without the traceback, so that a burst of 429s does not fill the log (what a flood once wrote:
    ``docs/bench/cpu-speed.md``, "Figures behind rules in the code")."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (ReplicaOverloadedError, ValueError)):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = f"request refused: {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        return True


def in_serve_replica() -> bool:
    """Whether this code runs inside a Serve replica (``serve.get_replica_context()`` works)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


def log_to_stderr(level: int = logging.INFO) -> None:
    """In a ``carpool`` CLI process: Carpool's records at ``level`` and above go to stderr as
    ``INFO carpool <logger>: <message>``. Calling it again changes nothing."""
    formatter = logging.Formatter("%(levelname)s carpool %(name)s: %(message)s")
    for name in CARPOOL_LOGGERS:
        target = logging.getLogger(name)
        target.setLevel(level)
        if not any(isinstance(handler, _Stderr) for handler in target.handlers):
            handler = _Stderr()
            handler.setFormatter(formatter)
            target.addHandler(handler)
        target.propagate = False


def log_through_serve() -> None:
    """In a Serve replica (engine or ingress): Carpool's records go through Serve's ``ray.serve``
    logger, at its level (INFO by default): to the replica's file under
    ``<ray session>/logs/serve/`` and, with ``RAY_SERVE_LOG_TO_STDERR`` (Serve's default), to the
    stderr that Ray forwards to the driver's console. Does nothing outside a Serve replica (the
    deployment class built directly, as some tests do): there the application's setup decides.

    The loggers are set to DEBUG so that a record reaches :class:`_ToServe`, which drops those
    below Serve's level; a ``logger.debug`` call therefore builds its record (about 30 us), so
    keep debug lines out of per-step code.
    """
    if not in_serve_replica():
        return
    for name in CARPOOL_LOGGERS:
        target = logging.getLogger(name)
        target.setLevel(logging.DEBUG)
        target.handlers = [_ToServe()]
        target.propagate = False


def log_refusals_in_one_line() -> None:
    """In the engine's Serve replica (``LLMReplica``, whose methods raise ``ValueError`` only to
    refuse a request): Serve logs a refused request in one WARNING line (:class:`_RefusalsInOneLine`);
    every other exception keeps its ERROR line and traceback. Not for the ingress, where a
    ``ValueError`` escaping a handler is a bug. Does nothing outside a Serve replica; calling it
    again adds nothing."""
    if not in_serve_replica():
        return
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, _RefusalsInOneLine) for f in serve_logger.filters):
        serve_logger.addFilter(_RefusalsInOneLine())  # a logger's filters outlive Serve's reconfigures
