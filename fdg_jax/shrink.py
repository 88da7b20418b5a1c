"""FDG's gradient shrinking under its first module name: a thin module re-exporting
`fdg_jax.optim.shrinking` (`shrink(beta, k, K)` is `optax.scale(beta ** (K-1-k))`)."""

from fdg_jax.optim.shrinking import shrink, shrink_factor

__all__ = ["shrink", "shrink_factor"]
