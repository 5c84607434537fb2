"""OpenAI's Responses API, translated onto the chat path."""
