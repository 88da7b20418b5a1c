"""The trainer: `train_and_evaluate(config, workdir)` and what it is made of.

One tick of the chosen schedule per batch; evaluation every `eval_every_epochs`; orbax
checkpoints that hold everything needed for an exact resume (every stage's params, model
state, optimizer state and stash, the messages in flight, the tick, the data position).
Re-running with the same workdir resumes from the latest checkpoint.

User errors (a bad config, a missing dataset, a diverged run) raise `UserError` subclasses
whose message is one line; `train.py` prints it and exits non-zero without a traceback.

Modules, one concern each:

- `prepare`: from a config to the model, data, stages and schedule (`setup`,
  `make_schedule`, `choose_placement`, `resolve_auto`, `auto_fields`, `setup_cpu_devices`);
- `checkpoints`: the orbax checkpoints (`Checkpointer`, `CheckpointError`);
- `loop`: the training loop (`train_and_evaluate`, `TrainingLoop`, signals, watchdog);
- `evaluation`: test-set metrics (`evaluate`) and the finiteness checks of a state;
- `metrics`: metrics.jsonl and TensorBoard (`METRICS_FILE`), the progress bar, console lines.

Every public name is re-exported here. To replace a function that the trainer calls (a
test's monkeypatch), patch it in the module that holds it: a name re-exported here is a
second reference, and the trainer does not read it.
"""

from fdg_jax.config_check import ConfigError, UserError, validate
from fdg_jax.trainer.checkpoints import CHECKPOINT_DIR, Checkpointer, CheckpointError
from fdg_jax.trainer.evaluation import evaluate
from fdg_jax.trainer.loop import (STALL_STACKS, DivergedError, Interrupted, TrainingLoop,
                                  train_and_evaluate)
from fdg_jax.trainer.metrics import METRICS_FILE
from fdg_jax.trainer.prepare import (CONFIG_CHANGES_FILE, Run, auto_fields, choose_placement,
                                     loss_fn, make_schedule, resolve_auto, setup,
                                     setup_cpu_devices, staleness_hparams)

__all__ = [
    "CHECKPOINT_DIR", "CONFIG_CHANGES_FILE", "CheckpointError", "Checkpointer", "ConfigError",
    "DivergedError", "Interrupted", "METRICS_FILE", "Run", "STALL_STACKS", "TrainingLoop",
    "UserError", "auto_fields", "choose_placement", "evaluate", "loss_fn", "make_schedule",
    "resolve_auto", "setup", "setup_cpu_devices", "staleness_hparams", "train_and_evaluate",
    "validate",
]
