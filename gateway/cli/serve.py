"""``kvgate serve``: the HTTP API and, with ``--lm-port``, lm:// on one Store."""

from __future__ import annotations

import ipaddress
import logging
import os
from functools import partial
from typing import Annotated

import typer
from rich.console import Console

from gateway.bearer import token_problem
from gateway.config import parse_size

err = Console(stderr=True, soft_wrap=True)  # a message stays one line, however long

LOOPBACK_NAMES = ("localhost",)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def serve(
    config: Annotated[
        str | None,
        typer.Option(
            "--config", "-f", help="YAML config (default: $KVGATE_CONFIG or memory + disk)"
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="bind address; other than loopback only with a token")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8080,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="KVGATE_TOKEN",
            show_default=False,
            help="bearer token clients must send (prefer $KVGATE_TOKEN: argv is visible)",
        ),
    ] = None,
    lm_port: Annotated[
        int | None, typer.Option(help="also serve LMCache's lm:// protocol on this port")
    ] = None,
    lm_host: Annotated[
        str,
        typer.Option(help="lm:// bind address; lm:// has no authentication: see --lm-public"),
    ] = "127.0.0.1",
    lm_public: Annotated[
        bool,
        typer.Option(
            "--lm-public",
            help="allow a non-loopback --lm-host: whoever reaches it reads and overwrites "
            "every object, --token or not",
        ),
    ] = False,
    lm_idle_timeout: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="close lm:// connections idle this long (LMCache's client never reconnects)",
        ),
    ] = None,
    max_body: Annotated[str, typer.Option(help="largest request body")] = "1GiB",
    body_timeout: Annotated[
        float, typer.Option(min=0.001, help="seconds a request body may stall (then 408)")
    ] = 20.0,
    body_min_rate: Annotated[
        str, typer.Option(help="bytes/s a body must average after --body-timeout s (0: any)")
    ] = "1MiB",
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="seconds a request's line and headers may take to arrive (then 408 and close)",
        ),
    ] = 10.0,
    max_header_bytes: Annotated[
        str,
        typer.Option(help="largest request URL and headers together (then 431 and close)"),
    ] = "64KiB",
    log_level: Annotated[
        str, typer.Option(help="log level of uvicorn and of kvgate's own lines")
    ] = "info",
) -> None:
    """Serve a Store over HTTP (object API, batch, lookup, tiers, metrics) and optionally lm://."""
    token = token or None  # an empty $KVGATE_TOKEN is no token
    problem = token_problem(token) if token is not None else None
    if problem is not None:  # no client could send it; the token itself is not shown
        err.print(f"kvgate serve: --token / $KVGATE_TOKEN: {problem}")
        raise typer.Exit(2)
    if not token and not _is_loopback(host):
        # Without authentication a non-loopback bind would expose the cache to the network.
        err.print(
            f"refusing to bind {host}: a non-loopback address needs a bearer token "
            "(--token or $KVGATE_TOKEN)"
        )
        raise typer.Exit(2)
    if lm_port is not None and not lm_public and not _is_loopback(lm_host):
        # lm:// (LMCache's protocol) has no authentication: the token does not protect it.
        err.print(
            f"refusing to serve lm:// on {lm_host}: lm:// has no authentication, so anyone "
            "who reaches the port could read and overwrite every object"
            + (", whatever --token protects over HTTP" if token else "")
            + "; pass --lm-public to expose it anyway"
        )
        raise typer.Exit(2)
    try:
        import uvicorn

        from gateway.http.app import create_app
        from gateway.http.head_limits import head_limits_protocol
        from gateway.lmcache.server import lm_serving
    except ModuleNotFoundError as exc:
        err.print(
            f"kvgate serve needs the serve extra ({exc.name} is missing): "
            "pip install 'kvgate[serve]'"
        )
        raise typer.Exit(2) from None
    from gateway.config import load_config, redact_url
    from gateway.errors import ConfigError, MissingDependency
    from gateway.store import check_plugins

    sizes: dict[str, int] = {}
    for option, value in [
        ("--max-body", max_body),
        ("--body-min-rate", body_min_rate),
        ("--max-header-bytes", max_header_bytes),
    ]:
        try:
            sizes[option] = parse_size(value)
            if sizes[option] == 0 and option != "--body-min-rate":  # 0 there: no rate limit
                raise ValueError("must be more than 0 bytes")
        except ValueError as exc:  # parse_size's ConfigError is one too
            err.print(f"kvgate serve: {option}: {exc}", markup=False, highlight=False)
            raise typer.Exit(2) from None
    try:  # uvicorn's protocol with a bound on each request's head (uvicorn has none)
        http = head_limits_protocol(header_timeout, "auto", max_bytes=sizes["--max-header-bytes"])
    except ValueError as exc:
        err.print(f"kvgate serve: --max-header-bytes: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    # KVGATE_TOKEN is this command's, not a config field: keep it out of the config's view.
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
    try:
        cfg = load_config(config, env=env)
        # Unknown codecs or schemes, a codec's missing key or calibration file: here, in one
        # line, rather than as a traceback from the service's start-up.
        check_plugins(cfg)
    except (ConfigError, MissingDependency) as exc:  # the message names the field: no traceback
        err.print(f"kvgate serve: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    tiers = " -> ".join(
        redact_url(t.url) + (f" ({t.capacity:,} B)" if t.capacity else "") for t in cfg.tiers
    )
    auth = "bearer token required" if token else "no authentication (loopback only)"
    lm = f", lm://{lm_host}:{lm_port} (no authentication)" if lm_port is not None else ""
    typer.echo(
        err=True,
        message=f"kvgate serve starting on http://{host}:{port}{lm}; {auth}; tiers: {tiers}",
    )
    application = create_app(
        cfg,
        token=token,
        max_body=sizes["--max-body"],
        body_timeout=body_timeout,
        body_min_rate=sizes["--body-min-rate"],
        companions=[]
        if lm_port is None
        else [partial(lm_serving, host=lm_host, port=lm_port, idle_timeout=lm_idle_timeout)],
    )
    log_to_stderr(log_level)
    state = application.state.kvgate
    # A refused start is reported below in one line: not as uvicorn's traceback of it.
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: state.startup_error is None or record.levelno < logging.ERROR
    )
    try:
        # uvloop and httptools when installed ("auto"); the plain asyncio loop and h11 otherwise.
        uvicorn.run(application, host=host, port=port, log_level=log_level, loop="auto", http=http)
    except SystemExit:  # uvicorn's exit status 3: the app did not start
        if state.startup_error is None:
            raise
    refusal = state.startup_error
    if refusal is not None:
        err.print(f"kvgate serve: not started: {refusal}", markup=False, highlight=False)
        raise typer.Exit(2 if isinstance(refusal, ConfigError | MissingDependency) else 1)


# kvgate's own loggers ("kvgate.*", and modules' ``__name__`` loggers), which uvicorn's
# logging set-up leaves alone: without a handler, Python prints only their warnings.
KVGATE_LOGGERS = ("kvgate", "gateway", "connectors", "serde", "gpu")


def log_to_stderr(level: str) -> None:
    """Send kvgate's log lines at ``level`` (uvicorn's names; ``trace`` is debug) and above
    to stderr, as uvicorn does its own: the breaker's half-open and closed lines are INFO."""
    threshold = logging.DEBUG if level.lower() == "trace" else logging.getLevelName(level.upper())
    if not isinstance(threshold, int):
        raise typer.BadParameter(f"unknown log level {level!r}", param_hint="--log-level")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:  %(name)s: %(message)s"))
    for name in KVGATE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(threshold)
        logger.handlers = [handler]
        logger.propagate = False  # once, even where the root logger has a handler too


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``kvgate`` command."""
    app.command()(serve)
