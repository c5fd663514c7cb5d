"""The worker: model, device KV pool, batch execution."""

import common as _common  # noqa: F401  (sets OpenMP's wait policy before torch loads)
