"""Request bodies as JSON Schema: each field declared once, checked when a body is read, published at /openapi.json."""
