"""SuperInfer: LLM serving that rotates requests between GPU and host memory.

The app: the CLI (composition root), supervisor, in-process engine, benchmarks and
simulator. Nothing imports it; it imports the services and `common`.
"""

import common as _common  # noqa: F401  (sets OpenMP's wait policy before torch loads)

__version__ = "0.1.0"
