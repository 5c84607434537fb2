"""The access plan: every epoch's index stream on every rank, which rank and node keeps which sample, the
RNG states an epoch starts from, and resume (also under another number of ranks)."""
