"""JAX's persistent compilation cache, on by default for the trainer and the benchmarks.

A resumed or repeated run compiles the same programs again (ResNet-20 at K=4: 10-30 s before
the first tick on 2 CPU cores). With the cache, XLA's compiled executables are written to a
directory shared by every run of the user, and a later process with the same program, JAX
version and devices loads them instead of compiling.

`enable(where)`: where = "auto" (the default directory: $FDG_JAX_CACHE_DIR, else
$XDG_CACHE_HOME/fdg_jax/xla, else ~/.cache/fdg_jax/xla), a directory, or "off" / "" (no
cache). It must run before the first compilation of the process. Programs that compile in
under `MIN_COMPILE_S` (or $FDG_JAX_CACHE_MIN_COMPILE_S) are not written: they cost less
than the file.
"""

from __future__ import annotations

import os

MIN_COMPILE_S = 0.1
OFF = ("", "off", "none", "false", "0")


def default_directory() -> str:
  if os.environ.get("FDG_JAX_CACHE_DIR"):
    return os.environ["FDG_JAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fdg_jax", "xla")


def resolve(where: str | None) -> str | None:
  """The cache directory `where` names, or None for no cache."""
  if where is None or str(where).strip().lower() in OFF:
    return None
  return default_directory() if where == "auto" else os.path.abspath(os.path.expanduser(where))


def enable(where: str | None = "auto") -> str | None:
  """Turns the persistent compilation cache on in `where` (see the module docstring);
  returns the directory, or None when off. An unwritable directory turns it off with a
  warning rather than failing the run."""
  import jax
  directory = resolve(where)
  if directory is None:
    return None
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    import warnings
    warnings.warn(f"compilation cache off: cannot create {directory} ({e.strerror})")
    return None
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("FDG_JAX_CACHE_MIN_COMPILE_S", MIN_COMPILE_S)))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory
