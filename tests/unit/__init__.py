"""Unit tests: one module at a time, no simulation engine, no network (a few start a short subprocess)."""
