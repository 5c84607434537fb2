"""Paged attention: the metadata of a step and the backends that compute it."""
