"""The engines that run a schedule's ticks, behind one interface (`base.Engine`).

- `fused.FusedEngine`: every stage in one program on one device;
- `per_stage.PerStageEngine`: a device per stage (or a (data, stage) mesh), each call jitted
  on its devices, messages moved between them;
- `spmd.SpmdEngine`: the ticks as one program over the devices, each running its own stage
  (plans whose calls read only the previous tick's messages: FDG).

Each engine module registers its class (`@base.register`): `CLASSES` is the one list of
engines, and each class's `plan_refusal` / `refusal` the one statement of what it runs. A new
engine is one module and that line. `choose` is the one place where "auto" is decided for
a placement, `preferred` the one place where it is decided from the devices a process
sees. No algorithm's name appears in an engine: what a tick does is the plan's.
"""

from fdg_jax.engines.base import (CLASSES, Engine, choose, names, plan_refusal, preferred,
                                  register)
from fdg_jax.engines.fused import FusedEngine
from fdg_jax.engines.per_stage import PerStageEngine
from fdg_jax.engines.spmd import SpmdEngine
from fdg_jax.stage_math import NO_UPDATE

__all__ = ["CLASSES", "Engine", "FusedEngine", "NO_UPDATE", "PerStageEngine", "SpmdEngine",
           "choose", "names", "plan_refusal", "preferred", "register"]
