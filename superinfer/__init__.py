"""SuperInfer: LLM serving that rotates requests between GPU and host memory."""

import os as _os

# OpenMP threads that spin at barriers collapse when another process holds a core (seen
# here: a batch-32 decode step 10x slower on 2 cores). Sleeping waits cost little when the
# machine is quiet. Must be set before torch loads its OpenMP runtime.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
