"""Carpool's INFO lines reach the console of a ``carpool`` command and a Serve replica's handlers."""

from __future__ import annotations

import logging
import subprocess
import sys

from replica.logs import CARPOOL_LOGGERS, SERVE_LOGGER, log_through_serve


def test_cli_process_prints_carpool_info_lines_once_and_not_other_libraries():
    script = (
        "import logging\n"
        "from replica.logs import log_to_stderr\n"
        "log_to_stderr(); log_to_stderr()\n"  # a second call adds no second handler
        "logging.getLogger('replica.deployment').info('ready: dtype=%s', 'bfloat16')\n"
        "logging.getLogger('cluster.app').debug('not at INFO')\n"
        "logging.getLogger('some.library').info('library chatter')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.splitlines() == ["carpool replica.deployment: ready: dtype=bfloat16"]


def test_serve_replica_loggers_use_serve_handlers_and_level():
    serve_logger = logging.getLogger(SERVE_LOGGER)
    saved = serve_logger.level, list(serve_logger.handlers)
    saved_carpool = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                            logging.getLogger(name).propagate) for name in CARPOOL_LOGGERS}
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    try:
        serve_logger.handlers = [Keep()]
        serve_logger.setLevel(logging.INFO)
        log_through_serve()
        logging.getLogger("router.ingress").info("ingress up")
        logging.getLogger("replica.engine").debug("below Serve's level")
        assert [record.getMessage() for record in records] == ["ingress up"]
    finally:
        serve_logger.setLevel(saved[0])
        serve_logger.handlers = saved[1]
        for name, (level, handlers, propagate) in saved_carpool.items():
            target = logging.getLogger(name)
            target.setLevel(level)
            target.handlers = handlers
            target.propagate = propagate
