"""Function calling: tools in the request, tool calls read from the model's text (whole or as it streams)."""
