"""The OpenAI-compatible HTTP ingress (FastAPI): ``create_app(backend)``. See app.py for the flow
and errors.py for the error mapping."""

from controlplane.api.app import create_app
from controlplane.api.errors import APIError

__all__ = ["APIError", "create_app"]
