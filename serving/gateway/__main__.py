"""``python -m unroll.serving.gateway [--host H] [--port P]``: the gateway alone, settings from ``UNROLL_*`` variables.

For a Triton that is already running (``unroll serve --triton-url`` does the same with set-up), and
for tests, which start gateways as real uvicorn processes with their own settings. The HTTP layer is
uvicorn's h11 protocol with the gateway's header deadline and size limits (:mod:`.server`).
"""

from __future__ import annotations

import argparse
import logging

import uvicorn
from unroll.serving.gateway.app import create_app
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.server import uvicorn_options
from unroll.serving.gateway.settings import Settings


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unroll.serving.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    try:
        settings = Settings.from_env()
        limits = HttpSettings()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=10, **uvicorn_options(limits))


if __name__ == "__main__":
    main()
