"""The cache tiers: shared memory, local disk, and what this node holds in them."""
