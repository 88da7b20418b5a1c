"""fdg_jax: decoupled neural-network training with delayed gradients in JAX.

Schedules: `bp` (backpropagation), `ddg` (Huo et al. 2018, backward unlocked) and `fdg`
(Zhuang et al. 2021, forward/backward/update unlocked, with gradient shrinking `beta`).
"""

from fdg_jax.delays import delay, ring_size
from fdg_jax.pipelines import SyncPipeline, gpipe, one_f_one_b
from fdg_jax.placement import Placement
from fdg_jax.schedules import ALGORITHMS, Schedule, bp, classification_metrics, create, ddg, fdg
from fdg_jax.shrink import shrink, shrink_factor
from fdg_jax.stages import Stage, forward, init_stages

__all__ = [
    "ALGORITHMS", "Placement", "Schedule", "Stage", "SyncPipeline", "bp",
    "classification_metrics", "create", "ddg", "delay", "fdg", "forward", "gpipe", "init_stages",
    "one_f_one_b", "ring_size",
    "shrink", "shrink_factor",
]
__version__ = "0.1.0"
