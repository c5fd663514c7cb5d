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

# Ten openings for the in-process engine tests (rotation, sampling): varied lengths and
# topics, so that a batch mixes short and long contexts.
OPENINGS = [
    "The history of the Roman Empire begins",
    "def quicksort(arr):",
    "Ten facts about octopuses:",
    "Dear hiring manager, I am writing to",
    "The recipe for a classic French omelette is",
    "In quantum mechanics, the uncertainty principle",
    "Mountains are formed when",
    "A short poem about autumn leaves:",
    "The three laws of thermodynamics are",
    "To install Python on Linux, first",
]
