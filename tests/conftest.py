"""Test set-up: four CPU devices so that stages can be placed apart."""

import os

# Fast XLA:CPU compiles: the suite compiles many small functions and runs each briefly.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                      "--xla_backend_optimization_level=0")

# Tests do not write the user's compilation cache (a test that needs it names its own).
os.environ.setdefault("FDG_JAX_COMPILATION_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
