"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the jpaged engine."""

from jpaged.server.app import BackgroundServer, build_app, default_model_name, run_server

__all__ = ["BackgroundServer", "build_app", "default_model_name", "run_server"]
