"""The peer exchange: samples from the ranks that hold them instead of storage."""
