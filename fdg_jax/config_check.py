"""Validation of a training config before any work: one clear line per problem."""

from __future__ import annotations

from fdg_jax.schedules import ALGORITHMS, BACKWARD_POLICIES


class UserError(Exception):
  """An error caused by the user's input; its message is one line, shown without traceback."""


class ConfigError(UserError, ValueError):
  """The config cannot work."""


REQUIRED = (
    "algorithm", "num_stages", "beta", "backward", "split", "model", "dataset", "data_dir",
    "batch_size", "num_epochs", "optimizer", "learning_rate", "momentum", "weight_decay",
    "lr_schedule", "warmup_epochs", "seed", "checkpoint_every_steps", "eval_every_epochs",
    "num_cpu_devices", "num_replicas",
)


def _fail(msg: str):
  raise ConfigError(msg)


def validate(config) -> None:
  """Raises ConfigError (one line: what is wrong, how to fix it) if `config` cannot work."""
  from fdg_jax import data, models  # imported lazily: validation runs before heavy set-up

  missing = [k for k in REQUIRED if k not in config]
  if missing:
    _fail(f"config lacks field(s) {', '.join(missing)}; start from configs/default.py")
  if config.algorithm not in ALGORITHMS:
    _fail(f"unknown algorithm {config.algorithm!r}; use --config.algorithm=bp|ddg|fdg")
  if config.backward not in BACKWARD_POLICIES:
    _fail(f"unknown backward {config.backward!r}; use --config.backward=stash|recompute")
  if not isinstance(config.beta, (int, float)) or not 0.0 < config.beta <= 1.0:
    _fail(f"beta={config.beta} must lie in (0, 1]; 1 disables gradient shrinking")
  if config.dataset not in data.list_datasets():
    _fail(f"unknown dataset {config.dataset!r}; known: {', '.join(data.list_datasets())}")
  try:
    model = models.create(config.model, num_classes=data.get_spec(config.dataset).num_classes,
                          **dict(config.get("model_kwargs", {}) or {}))
  except ValueError as e:
    _fail(str(e).splitlines()[0])
  K = config.num_stages
  if not isinstance(K, int) or K < 1:
    _fail(f"num_stages={K} must be a positive integer")
  if K > model.num_blocks:
    _fail(f"num_stages={K} exceeds the {model.num_blocks} blocks of {config.model}; use at "
          f"most {model.num_blocks} stages or a deeper model")
  split = config.split
  if isinstance(split, str) and split and split[0].isdigit():
    try:
      bounds = [int(b) for b in split.split(",")]
    except ValueError:
      _fail(f"split={split!r}: explicit boundaries are comma-separated integers, e.g. 3,6,9")
    from fdg_jax import partition
    try:
      partition.check_boundaries(bounds, K, model.num_blocks)
    except ValueError as e:
      _fail(f"split={split!r}: {str(e).splitlines()[0]}")
  elif split not in ("uniform", "balanced", "paper"):
    _fail(f"unknown split {split!r}; use uniform, balanced, paper or boundaries like 3,6,9")
  elif split == "paper" and K > 1 and K not in model.paper_splits:
    _fail(f"no paper split of {config.model} into {K} stages; use --config.split=balanced")
  if config.num_replicas < 1:
    _fail(f"num_replicas={config.num_replicas} must be >= 1")
  if config.batch_size < 1 or config.batch_size % config.num_replicas:
    _fail(f"batch_size={config.batch_size} must be a positive multiple of "
          f"num_replicas={config.num_replicas}")
  if config.get("eval_batch_size", 1) % config.num_replicas:
    _fail(f"eval_batch_size={config.eval_batch_size} must be a multiple of "
          f"num_replicas={config.num_replicas}")
  if config.num_epochs < 1:
    _fail(f"num_epochs={config.num_epochs} must be >= 1")
  if config.optimizer not in ("sgd", "adam"):
    _fail(f"unknown optimizer {config.optimizer!r}; use sgd or adam")
  if not config.learning_rate > 0:
    _fail(f"learning_rate={config.learning_rate} must be > 0")
  if not 0.0 <= config.momentum < 1.0:
    _fail(f"momentum={config.momentum} must lie in [0, 1)")
  if config.weight_decay < 0:
    _fail(f"weight_decay={config.weight_decay} must be >= 0")
  if config.lr_schedule not in ("constant", "multistep", "cosine"):
    _fail(f"unknown lr_schedule {config.lr_schedule!r}; use constant, multistep or cosine")
  if config.warmup_epochs < 0 or config.warmup_epochs > config.num_epochs:
    _fail(f"warmup_epochs={config.warmup_epochs} must lie in [0, num_epochs]")
  if config.checkpoint_every_steps < 1 or config.eval_every_epochs < 1:
    _fail("checkpoint_every_steps and eval_every_epochs must be >= 1")
