"""`superinfer sim`: the real scheduler on a simulated clock with cost models (DESIGN 7)."""
