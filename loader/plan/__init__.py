"""The access plan: every epoch's index stream, what each node keeps, and resume."""
