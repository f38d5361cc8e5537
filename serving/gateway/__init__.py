"""The REST gateway in front of Triton: ``create_app(Settings(...))`` (FastAPI), run with uvicorn."""

from unroll.serving.gateway.app import create_app
from unroll.serving.gateway.settings import Settings

__all__ = ["Settings", "create_app"]
