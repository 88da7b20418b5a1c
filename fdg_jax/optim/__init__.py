"""The optimiser side: base optimisers, staleness remedies and their registry.

Modules, each holding one kind of thing:

- `factory`: the base optimiser by name (`make_optimizer`, `find_optimizer`,
  `optimizer_parameters`) and the papers' learning-rate schedules (`learning_rate_schedule`);
  re-exported here, as `fdg_jax.optim` has always offered them.
- `adaptive`: the library's own Adam variants meant to tolerate delay (`basis_rotation`,
  `nadam_warmup`), and `cpu_lapack`, the factorisations basis_rotation runs on CPU.
- `delayed`: the delayed-transform protocol the schedules run every stage's optimiser
  through (`DelayedTransformation`, `with_forward`, `chain`).
- `remedies`: the staleness remedies of the papers, each a transform of the stage's delay.
- `methods`: the registry of staleness methods by name (`--config.staleness`): settings,
  config fields and their validation, and how a stage's transform is built and combined
  (`stage_optimizer`).
- `auto`: `--config.staleness=auto`, the time-to-quality study's held-out choice (`recommend`).
- `shrinking`: FDG's gradient shrinking, `optax.scale` by beta ** (K-1-k) (`shrink`).

`fdg_jax.staleness`, `fdg_jax.optimizers` and `fdg_jax.shrink` re-export these under the
names they had before the package.
"""

from fdg_jax.optim.factory import (OWN, find_optimizer, learning_rate_schedule, make_optimizer,
                                   optimizer_parameters)

__all__ = ["OWN", "find_optimizer", "learning_rate_schedule", "make_optimizer",
           "optimizer_parameters"]
