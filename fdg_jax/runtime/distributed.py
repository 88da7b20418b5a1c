"""Joining JAX's multi-controller runtime (`jax.distributed.initialize`) from the environment.

Every process runs the same program; each sees only its own devices, feeds its own slice of
the global batch, and the processes meet in the collectives that jit inserts (the gradient
all-reduce of each stage over its replicas). On CPU those collectives need an
implementation: gloo, which ships with jaxlib.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax

from fdg_jax.runtime import peers

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # also read by jax.distributed itself
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Launchers under which jax.distributed.initialize() finds every argument by itself.
_AUTO_DETECTED = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: Sequence[int] | None = None,
               timeout_s: int = 300, peer_timeout_s: int = peers.DEFAULT_TIMEOUT_S) -> bool:
  """Starts the multi-process runtime if this process is one of several; else does nothing.

  Call it first, before any other JAX call. Each argument defaults to its environment
  variable (JAX_COORDINATOR_ADDRESS "host:port", JAX_NUM_PROCESSES, JAX_PROCESS_ID), as set
  by `python -m fdg_jax.launch`. Without them, under SLURM or Open MPI with more than one
  task, JAX detects the cluster itself. `timeout_s` bounds the wait for every process to
  join; `peer_timeout_s` is how long a process may go without a heartbeat before the
  coordination service declares it lost (JAX's default is 100 s; under `train.py` the others
  then end with one line and exit code `peers.EXIT_CODE`, see `fdg_jax.runtime.peers`).

  Returns:
    True if this process joined a multi-process run (it is now `jax.process_index()` of
    `jax.process_count()`), False for a single-process run.
  """
  if jax.distributed.is_initialized():
    return True
  env = os.environ
  address = coordinator_address or env.get(ENV_COORDINATOR)
  if num_processes is None and env.get(ENV_NUM_PROCESSES):
    num_processes = int(env[ENV_NUM_PROCESSES])
  if process_id is None and env.get(ENV_PROCESS_ID):
    process_id = int(env[ENV_PROCESS_ID])
  given = (address, num_processes, process_id)
  if all(v is None for v in given):
    if not any(int(env.get(name, "1") or 1) > 1 for name in _AUTO_DETECTED):
      return False
    _use_cpu_collectives()
    jax.distributed.initialize(initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=int(peer_timeout_s))
    return True
  if num_processes == 1:
    return False
  if any(v is None for v in given):
    got = dict(zip((ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID), given))
    raise ValueError(f"a multi-process run needs all of {ENV_COORDINATOR}, "
                     f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} (or the arguments); got {got}")
  _use_cpu_collectives()
  jax.distributed.initialize(address, num_processes, process_id,
                             local_device_ids=local_device_ids,
                             initialization_timeout=timeout_s,
                             heartbeat_timeout_seconds=int(peer_timeout_s))
  return True


def _use_cpu_collectives() -> None:
  """Cross-process collectives on CPU through gloo, unless the user chose otherwise."""
  if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
