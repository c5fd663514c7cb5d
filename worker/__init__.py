"""The worker: model, device KV pool, batch execution."""

import superinfer as _superinfer  # noqa: F401  (sets OpenMP's wait policy before torch loads)
