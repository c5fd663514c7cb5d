"""Prompts the real-stack tests stream at once: short, varied, greedy-decodable."""

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Hello, my name is",
    "The three primary colors are",
    "Translate to German: good morning",
    "Once upon a time, in a small village,",
]
