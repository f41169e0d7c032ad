"""``kvgate serve`` shows kvgate's own log lines at its ``--log-level``: uvicorn's logging
set-up leaves kvgate's loggers without a handler, and Python then prints only warnings (the
circuit breaker's half-open and closed lines, at INFO, never appeared)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from gateway.cli.serve import KVGATE_LOGGERS, log_to_stderr


@pytest.fixture
def restored_loggers() -> Iterator[None]:
    saved = {}
    for name in KVGATE_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (logger.level, list(logger.handlers), logger.propagate)
    yield
    for name, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers = handlers
        logger.propagate = propagate


@pytest.mark.usefixtures("restored_loggers")
def test_kvgate_lines_at_the_serve_level_reach_stderr_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log_to_stderr("info")
    logging.getLogger("kvgate.layers").info("circuit breaker closed after 3 s")
    logging.getLogger("connectors.redis.connector").debug("not at info")
    logging.getLogger("gateway.config").warning("a warning")
    err = capsys.readouterr().err
    assert err.count("circuit breaker closed after 3 s") == 1
    assert "not at info" not in err
    assert "a warning" in err
    log_to_stderr("trace")
    logging.getLogger("connectors.redis.connector").debug("now shown")
    assert "now shown" in capsys.readouterr().err


def test_an_unknown_level_is_refused() -> None:
    with pytest.raises(Exception, match="unknown log level"):
        log_to_stderr("chatty")
