"""Reading ahead in plan order, from storage into the cache."""
