"""``python -m unroll.serving.gateway [--host H] [--port P]``: the gateway alone, settings from ``UNROLL_*`` variables.

For a Triton that is already running (``unroll serve --triton-url`` does the same with set-up), and
for tests, which start gateways as real uvicorn processes with their own settings. The HTTP layer is
uvicorn's httptools protocol on uvloop with the gateway's header deadline and size limits (:mod:`.server`).
"""

from __future__ import annotations

import argparse
import logging.config
import os

import uvicorn

from unroll.serving.gateway.app import create_app
from unroll.serving.gateway.http_settings import ACCESS_LOG_ENV, HttpSettings
from unroll.serving.gateway.request_id import LOG_FORMAT_ENV, log_config, log_format
from unroll.serving.gateway.server import uvicorn_options
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.workers import WORKERS_ENV, check_workers, run_workers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unroll.serving.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info")
    p.add_argument("--workers", default=None, help=f"gateway processes behind the port (default: ${WORKERS_ENV}, "
                                                    "else 1; see unroll.serving.gateway.workers)")
    p.add_argument("--access-log", action="store_true", help="one JSON line per request on stdout (default: "
                                                              f"${ACCESS_LOG_ENV}, else off)")
    p.add_argument("--log-format", choices=("text", "json"), default=None,
                   help=f"log lines as text or one JSON object each, with the request id (default: ${LOG_FORMAT_ENV}, "
                        "else text)")
    args = p.parse_args(argv)
    try:
        settings = Settings.from_env()
        if args.access_log:
            os.environ[ACCESS_LOG_ENV] = "1"  # for the workers too
        limits = HttpSettings()
        if args.log_format:
            os.environ[LOG_FORMAT_ENV] = args.log_format  # for the workers too
        log_format()  # UNROLL_LOG_FORMAT: text or json
        workers = check_workers(args.workers if args.workers is not None else os.environ.get(WORKERS_ENV) or 1)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    logging.config.dictConfig(log_config(args.log_level))  # before the app is built: its start-up lines too
    if workers > 1:
        os.environ.update(settings.env())  # the workers read their settings from the environment
        run_workers(args.host, args.port, workers, args.log_level, timeout_graceful_shutdown=10)
        return
    uvicorn.run(create_app(settings), host=args.host, port=args.port, timeout_graceful_shutdown=10,
                **uvicorn_options(limits, log_level=args.log_level))


if __name__ == "__main__":
    main()
