"""Prescient's OpenAI-compatible HTTP server (aiohttp) over the runtime engine."""

from server.app import build_app

__all__ = ["build_app"]
