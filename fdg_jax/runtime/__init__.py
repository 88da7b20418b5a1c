"""Runtime: where stages run (one device each, or a (data, stage) mesh) and multi-process set-up.

    fdg_jax.runtime.initialize()      # joins a multi-process run when launched as one
    mesh = fdg_jax.runtime.make_mesh(num_replicas=R, num_stages=K)
    schedule = fdg_jax.fdg(stages, loss_fn, optimizer, mesh=mesh)

Launch several processes on one machine with `python -m fdg_jax.launch --num-processes N
-- python train.py ...`; on a cluster, start one process per host with the JAX_* variables
of `initialize` (or under SLURM / Open MPI, where JAX finds them itself). A replica's stages
may lie in different processes (its messages cross through collectives); read values that
live in some processes only with `fetch`, in every process alike.
"""

from fdg_jax.placement import Placement, make_mesh, move
from fdg_jax.runtime import compile_cache, peers
from fdg_jax.runtime.arrays import fetch
from fdg_jax.runtime.distributed import (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                                         initialize)

__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "Placement", "fetch",
           "compile_cache", "initialize", "make_mesh", "move", "peers"]
