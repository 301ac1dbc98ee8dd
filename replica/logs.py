"""Where Carpool's own log lines go. Python drops INFO records of a logger nobody configured
(its last-resort handler prints WARNING and above), so the replica's ``ready: model=... dtype=...``
line and the app's ``deploying N replica(s)`` never showed. These two functions set Carpool's
loggers (``cluster``, ``replica``, ``router``) to INFO in its own processes; other libraries'
loggers keep their levels.
"""

from __future__ import annotations

import logging

CARPOOL_LOGGERS = ("cluster", "replica", "router")
SERVE_LOGGER = "ray.serve"  # ray.serve._private.constants.SERVE_LOGGER_NAME


def log_to_stderr(level: int = logging.INFO) -> None:
    """In a ``carpool`` CLI process: Carpool's records at ``level`` and above go to stderr as
    ``carpool <logger>: <message>``. Calling it again changes nothing."""
    formatter = logging.Formatter("carpool %(name)s: %(message)s")
    for name in CARPOOL_LOGGERS:
        target = logging.getLogger(name)
        target.setLevel(level)
        if not any(getattr(handler, "carpool", False) for handler in target.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(formatter)
            handler.carpool = True  # type: ignore[attr-defined]
            target.addHandler(handler)
        target.propagate = False


def log_through_serve() -> None:
    """In a Serve replica (engine or ingress): Carpool's loggers take the level and handlers that
    Serve gave its ``ray.serve`` logger from the deployment's ``logging_config`` (INFO by default):
    the replica's file under ``<ray session>/logs/serve/`` and, with ``RAY_SERVE_LOG_TO_STDERR``
    (Serve's default with its proxy), the stderr that Ray forwards to the driver's console."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    for name in CARPOOL_LOGGERS:
        target = logging.getLogger(name)
        target.setLevel(serve_logger.level or logging.INFO)
        target.handlers = list(serve_logger.handlers)
        target.propagate = False
