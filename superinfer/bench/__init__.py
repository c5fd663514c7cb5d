"""Benchmark commands (`superinfer bench …`): each prints a table and can write JSON."""
