"""The bottom layer: what every SuperInfer process shares.

The contracts that cross process boundaries (`contracts`, `wire`, `pool_handle`,
`dtypes`) and the base every service stands on (`errors`, `logging`, `daemon`, `shm`,
`modelfile`, `tokenizer`, `output`, `config`). It imports no service and no app module
(checked by `make lint`, docs/ARCHITECTURE.md).
"""

import os as _os

# OpenMP threads that spin at barriers collapse when another process holds a core (seen
# here: a batch-32 decode step 10x slower on 2 cores). Sleeping waits cost little when the
# machine is quiet. Must be set before torch loads its OpenMP runtime, so it is set here,
# in the package every process imports first.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
