"""`python -m fdg_jax.bench COMMAND ...` (see `fdg_jax.bench`)."""

import os
import sys


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # Programs compiled once serve later runs (FDG_JAX_COMPILATION_CACHE=off to measure
  # compilation itself).
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(os.environ.get("FDG_JAX_COMPILATION_CACHE", "auto"))
  if argv and argv[0] == "concurrency":
    from fdg_jax.bench import concurrency
    concurrency.main(argv[1:])
    return 0
  if argv and argv[0] == "nested":
    from fdg_jax.bench import nested
    nested.main(argv[1:])
    return 0
  if argv and argv[0] == "processes":
    from fdg_jax.bench import processes
    processes.main(argv[1:])
    return 0
  if argv and argv[0] == "cores":
    from fdg_jax.bench import cores
    cores.main(argv[1:])
    return 0
  if argv and argv[0] == "imports":
    from fdg_jax.bench import imports
    imports.main(argv[1:])
    return 0
  if argv and argv[0] == "data":
    from fdg_jax.bench import data
    data.main(argv[1:])
    return 0
  from fdg_jax.bench import cli
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main())
