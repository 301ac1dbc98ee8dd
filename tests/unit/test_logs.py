"""Carpool's INFO lines reach the console of a ``carpool`` command and a Serve replica's handlers."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import replica.serve.logs as logs
from replica.serve.logs import (
    CARPOOL_LOGGERS,
    SERVE_LOGGER,
    in_serve_replica,
    log_refusals_in_one_line,
    log_through_serve,
)


def test_cli_process_prints_carpool_info_lines_once_and_not_other_libraries():
    script = (
        "import io, logging, sys\n"
        "from replica.serve.logs import log_to_stderr\n"
        "log_to_stderr(); log_to_stderr()\n"  # a second call adds no second handler
        "logging.getLogger('replica.serve.deployment').info('ready: dtype=%s', 'bfloat16')\n"
        "logging.getLogger('cluster.app').debug('not at INFO')\n"
        "logging.getLogger('some.library').info('library chatter')\n"
        # a test runner's stderr, swapped in and closed again, must not swallow later lines
        "real, sys.stderr = sys.stderr, io.StringIO(); sys.stderr.close(); sys.stderr = real\n"
        "logging.getLogger('router.ingress').warning('still shown')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.splitlines() == [
        "INFO carpool replica.serve.deployment: ready: dtype=bfloat16",
        "WARNING carpool router.ingress: still shown",
    ]


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.records.append(record)


def logger_state(names) -> dict[str, tuple]:
    """Each named logger's (level, handlers, propagate)."""
    return {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                   logging.getLogger(name).propagate) for name in names}


@pytest.fixture
def loggers():
    """Serve's and Carpool's loggers as they were, restored after the test."""
    saved = logger_state((SERVE_LOGGER, *CARPOOL_LOGGERS))
    yield
    for name, (level, handlers, propagate) in saved.items():
        target = logging.getLogger(name)
        target.setLevel(level)
        target.handlers = handlers
        target.propagate = propagate


def test_serve_replica_loggers_follow_serve_level_and_handlers_also_after_a_reconfigure(loggers, monkeypatch):
    monkeypatch.setattr(logs, "in_serve_replica", lambda: True)  # as in a replica's __init__
    serve_logger = logging.getLogger(SERVE_LOGGER)
    first, second = Keep(), Keep()
    serve_logger.handlers = [first]
    serve_logger.setLevel(logging.INFO)
    log_through_serve()
    logging.getLogger("router.ingress").info("ingress up")
    logging.getLogger("replica.engine.llm_engine").debug("below Serve's level")
    assert first.messages == ["ingress up"]
    # Serve reconfigures a running replica in place (a new logging_config): Carpool follows.
    serve_logger.handlers = [second]
    serve_logger.setLevel(logging.WARNING)
    logging.getLogger("replica.engine.llm_engine").info("now below Serve's level")
    logging.getLogger("replica.engine.llm_engine").error("step failed")
    assert first.messages == ["ingress up"] and second.messages == ["step failed"]


def test_outside_serve_the_application_logging_setup_is_left_alone(loggers):
    from ray import serve  # noqa: F401  (importing Serve gives its logger a handler)

    assert logging.getLogger(SERVE_LOGGER).handlers and not in_serve_replica()
    before, filters = logger_state(CARPOOL_LOGGERS), list(logging.getLogger(SERVE_LOGGER).filters)
    log_through_serve()
    log_refusals_in_one_line()
    assert logger_state(CARPOOL_LOGGERS) == before and logging.getLogger(SERVE_LOGGER).filters == filters


def test_the_engine_replica_logs_a_refused_request_in_one_warning_line_and_a_failure_with_its_traceback(loggers, monkeypatch):
    from replica.protocol.errors import ReplicaOverloadedError

    monkeypatch.setattr(logs, "in_serve_replica", lambda: True)
    serve_logger = logging.getLogger(SERVE_LOGGER)
    saved_filters = list(serve_logger.filters)
    keep = Keep()
    serve_logger.handlers, serve_logger.propagate = [keep], False
    serve_logger.setLevel(logging.INFO)
    try:
        log_through_serve()  # the ingress's setup: refusals keep Serve's own line
        try:
            raise ValueError("a bug in a handler")
        except ValueError:
            serve_logger.exception("Request failed.")
        log_refusals_in_one_line()
        log_refusals_in_one_line()  # one filter, however often a replica starts in this process
        assert sum(type(f).__name__ == "_RefusalsInOneLine" for f in serve_logger.filters) == 1
        for exc in (ReplicaOverloadedError("replica is full: 12 requests held"), ValueError("max_tokens must be at least 0"),
                    RuntimeError("boom")):
            try:
                raise exc
            except Exception:
                serve_logger.exception("Request failed.")  # as Serve's replica does
    finally:
        serve_logger.filters = saved_filters
    ingress_bug, full, bad, failed = keep.records
    assert ingress_bug.levelname == "ERROR" and ingress_bug.exc_info[0] is ValueError
    assert (full.levelname, full.getMessage(), full.exc_info) == (
        "WARNING", "request refused: ReplicaOverloadedError: replica is full: 12 requests held", None)
    assert (bad.levelname, bad.getMessage(), bad.exc_info) == (
        "WARNING", "request refused: ValueError: max_tokens must be at least 0", None)
    assert failed.levelname == "ERROR" and failed.getMessage() == "Request failed." and failed.exc_info[0] is RuntimeError
