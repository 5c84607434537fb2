"""Ollama's API, translated onto the chat path."""
