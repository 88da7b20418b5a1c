"""The delay-tolerant Adam variants under their first module name: a thin module
re-exporting `fdg_jax.optim.adaptive`, where `basis_rotation` and `nadam_warmup` live."""

from fdg_jax.optim.adaptive import (BasisRotationState, NadamWarmupState, basis_rotation,
                                    default_rotation_mask, matrix_view, nadam_warmup)

__all__ = ["BasisRotationState", "NadamWarmupState", "basis_rotation", "default_rotation_mask",
           "matrix_view", "nadam_warmup"]
