"""Integration tests: the real Flower simulation engine (Ray) or the in-process runner, end to end."""
