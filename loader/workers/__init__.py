"""The iterators and worker processes that turn cached bytes into batches."""
