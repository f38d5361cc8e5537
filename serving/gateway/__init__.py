"""The REST gateway in front of Triton: ``create_app(Settings(...))`` (FastAPI), run with uvicorn."""

from serving.gateway.app import create_app
from serving.gateway.settings import Settings

__all__ = ["Settings", "create_app"]
