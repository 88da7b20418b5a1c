"""fdg_jax: decoupled training with delayed gradients (BP, DDG, FDG) in JAX."""
