"""LAPACK factorisations inside XLA:CPU programs, without the two ways they stall a run.

jaxlib (0.10) runs a `jnp.linalg` factorisation on CPU (QR, eigh, ...) as a call into
LAPACK from XLA:CPU's intra-op thread pool, which has one thread per core. Two things go
wrong when such calls run inside a pipeline's programs, where several run at once:

1. **A deadlock.** For a batch of matrices, jaxlib's kernel splits the batch into chunks,
   schedules them on that same pool and blocks its own pool thread until every chunk is
   done. When as many such calls are in flight as the pool has threads (independent groups
   of one program, the programs of successive ticks, or of other stages on other CPU
   devices), every thread waits for chunks that no thread is left to run: the process hangs
   with every thread idle. A call on a batch of one has nothing to split and runs inline, so
   `one_at_a_time_on_cpu` decomposes the matrices in turn (`lax.map`, one call each; the
   same LAPACK routine on the same matrix, so bitwise the same result).
2. **Oversubscription.** The LAPACK that jaxlib calls is SciPy's OpenBLAS, which starts
   threads of its own (one per core) for each call; inside an already parallel pool they
   spin against XLA's threads. On 2 cores a pipeline's `run` under `basis_rotation` was
   5-7x slower with them than with OpenBLAS single-threaded (benchmarks/no_hang.py).
   `single_threaded_scipy_blas` sets SciPy's OpenBLAS (and only it: NumPy's own BLAS keeps
   its threads) to one thread, once per process.

GPUs and TPUs use their own solvers and keep the batched calls.
"""

from __future__ import annotations

import os
from typing import Callable

import jax

_done = False


def one_at_a_time_on_cpu(decompose: Callable, a: jax.Array):
  """`decompose`, a factorisation of a batch [B, ...] of matrices, applied to `a`; where
  the program runs on XLA:CPU, one matrix per LAPACK call (module docstring, item 1)."""
  if a.shape[0] == 1:
    return decompose(a)

  def one_by_one(a):
    return jax.lax.map(lambda m: jax.tree.map(lambda r: r[0], decompose(m[None])), a)

  return jax.lax.platform_dependent(a, cpu=one_by_one, default=decompose)


def single_threaded_scipy_blas() -> bool:
  """Sets the OpenBLAS that SciPy ships (the LAPACK jaxlib calls on CPU) to one thread, once
  per process (module docstring, item 2). Returns whether a library was found and set.

  Process-wide: SciPy's own `scipy.linalg` calls in this process run single-threaded from
  then on. Nothing happens where SciPy links another BLAS, or where `threadpoolctl` is
  missing.
  """
  global _done
  if _done:
    return True
  try:
    import scipy
    import scipy.linalg.cython_lapack  # noqa: F401  loads the library, as jaxlib does
    from threadpoolctl import ThreadpoolController
  except ImportError:
    return False
  root = os.path.dirname(os.path.abspath(scipy.__file__))
  own = (root + os.sep, root + ".libs" + os.sep)
  found = False
  for lib in ThreadpoolController().lib_controllers:
    if lib.internal_api == "openblas" and os.path.abspath(lib.filepath).startswith(own):
      lib.set_num_threads(1)
      found = True
  _done = found
  return found
