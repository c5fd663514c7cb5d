"""SuperInfer: LLM serving that rotates requests between GPU and host memory."""

__version__ = "0.1.0"
