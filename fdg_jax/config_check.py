"""Validation of a training config before any work: one clear line per problem."""

from __future__ import annotations

from fdg_jax import plans
from fdg_jax.optim import methods as staleness_methods
from fdg_jax.optim.factory import make_optimizer
from fdg_jax.schedules import BACKWARD_POLICIES


def _process_count() -> int:
  import jax
  return jax.process_count()


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


def unknown_override(config, argv) -> str | None:
  """One line naming the first `--config.a.b=...` of `argv` that names no field of `config`
  (and the closest field there), or None when every override names one.

  ml_collections refuses such a flag with a KeyError whose text is a repr spanning lines;
  this says the same in words. A field that holds a dict of free parameters
  (`optimizer_kwargs`, `model_kwargs`) takes new keys only as one value, given as JSON.
  """
  import difflib
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config."):].split("=", 1)[0]
    node, done = config, []
    for part in path.split("."):
      keys = sorted(node.keys()) if hasattr(node, "keys") else []
      if part in keys:
        node = node[part]
        done.append(part)
        continue
      name = ".".join(done + [part])
      if not hasattr(node, "keys"):
        return (f"--config.{name}: --config.{'.'.join(done)} is a value, not a group of "
                "fields")
      close = difflib.get_close_matches(part, keys, n=1)
      if close:
        hint = f"; did you mean --config.{'.'.join(done + [close[0]])}?"
      elif done and done[-1].endswith("_kwargs"):
        parent = ".".join(done)
        hint = (f"; {parent} takes new parameters as one JSON value, "
                f"--config.{parent}='{{\"{part}\": ...}}'")
      else:
        hint = "; docs/configs.md lists every field"
      return f"unknown config field {name!r} (in {arg}){hint}"
  return None


def _import_plan_module(config) -> None:
  """Imports the module --config.plan_module names (it registers schedules)."""
  name = config.get("plan_module", "")
  if not name:
    return
  import importlib
  try:
    importlib.import_module(name)
  except Exception as e:  # noqa: BLE001  one line, whatever the module raised
    _fail(f"plan_module {name!r} could not be imported ({type(e).__name__}: {e}); give a "
          "module on the Python path that calls fdg_jax.plans.register")


def validate_fields(config) -> None:
  """Checks every field that needs no model: ConfigError (one line) on the first problem."""
  from fdg_jax.data import kinds  # imported lazily: validation runs before heavy set-up

  missing = [k for k in REQUIRED if k not in config]
  if missing:
    _fail(f"config lacks field(s) {', '.join(missing)}; start from configs/default.py")
  _validate_numbers(config)
  _import_plan_module(config)
  if config.algorithm not in plans.names():
    _fail(f"unknown algorithm {config.algorithm!r}; use "
          f"--config.algorithm={'|'.join(plans.names())} (or register one with "
          "fdg_jax.plans.register in the module --config.plan_module names)")
  spec = plans.spec(config.algorithm)
  if config.beta != 1.0 and "beta" not in spec.options:
    _fail(f"beta={config.beta}: gradient shrinking is an option of "
          f"{' and '.join(n for n in plans.names() if 'beta' in plans.spec(n).options)}; "
          f"use --config.beta=1.0 with {config.algorithm}")
  if config.get("shrink_at", "gradient") != "gradient" and "shrink_at" not in spec.options:
    _fail(f"shrink_at={config.shrink_at!r} applies to gradient shrinking, which "
          f"{config.algorithm} does not take; use --config.shrink_at=gradient")
  if not spec.delayed and config.get("staleness", "none") not in ("none", "auto"):
    _fail(f"{config.algorithm} has no delay: use --config.staleness=none")
  if spec.microbatched:
    m = config.get("microbatches", 1)
    if not isinstance(m, int) or m < 1 or config.batch_size % m:
      _fail(f"microbatches={m} must be a positive integer that divides batch_size="
            f"{config.batch_size} ({config.algorithm} splits each batch into equal parts)")
  if config.num_replicas > 1 and not spec.replicas:
    _fail(f"{config.algorithm} runs on one device or a device per stage: use "
          "--config.num_replicas=1")
  if config.backward not in BACKWARD_POLICIES:
    _fail(f"unknown backward {config.backward!r}; use --config.backward=stash|recompute")
  if not isinstance(config.beta, (int, float)) or not 0.0 < config.beta <= 1.0:
    _fail(f"beta={config.beta} must lie in (0, 1]; 1 disables gradient shrinking")
  if config.get("shrink_at", "gradient") not in ("gradient", "update"):
    _fail(f"unknown shrink_at {config.shrink_at!r}; use --config.shrink_at=gradient|update")
  spec = kinds.lookup(config.dataset)
  if spec is None:
    _fail(f"unknown dataset {config.dataset!r}; known: {', '.join(kinds.names())} (or add "
          "yours with fdg_jax.data.register)")
  problem = spec.check(config)
  if problem:
    _fail(problem)
  if not isinstance(config.num_stages, int) or config.num_stages < 1:
    _fail(f"num_stages={config.num_stages} must be a positive integer")
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
  _validate_optimizer(config)
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
  _validate_staleness(config)
  _validate_telemetry(config)
  if config.get("dtype", "float32") not in ("float32", "bfloat16"):
    _fail(f"unknown dtype {config.dtype!r}; use --config.dtype=float32|bfloat16 (bfloat16: "
          "compute and activations in bf16, float32 weights and optimizer state)")
  from fdg_jax import engines
  engine = config.get("engine", "auto")
  if engine != "auto" and engine not in engines.CLASSES:
    _fail(f"unknown engine {config.engine!r}; use --config.engine="
          f"{'|'.join(('auto',) + engines.names())}")
  if engine != "auto":
    plan = plans.plan(config.algorithm, config.num_stages,
                      microbatches=config.get("microbatches", 1))
    why = engines.plan_refusal(engine, plan)
    if why:
      _fail(why.replace("engine='", "--config.engine='"))
  if engine == "spmd":
    if config.get("telemetry_every_steps", 0) > 0:
      _fail("engine=spmd has no staleness telemetry; use --config.engine=per_stage or fused")
  if config.get("gate", "auto") not in ("auto", "mask", "cond"):
    _fail(f"unknown gate {config.gate!r}; use --config.gate=auto|mask|cond")
  workers = config.get("data_workers", 0)
  if not isinstance(workers, int) or workers < 0:
    _fail(f"data_workers={workers} must be an integer >= 0 (0: decode in this process)")
  for key in ("checkpoint_every_steps", "eval_every_epochs", "log_every_steps",
              "eval_batch_size", "ticks_per_call"):
    if key in config and (not isinstance(config[key], int) or config[key] < 1):
      _fail(f"{key}={config[key]} must be an integer >= 1")
  every = config.get("eval_every_steps", 0)
  if isinstance(every, bool) or not isinstance(every, int) or every < 0:
    _fail(f"eval_every_steps={every!r} must be an integer >= 0 (0: evaluate by epochs only)")
  for key in ("stall_timeout_s", "stall_first_tick_s"):
    if key in config and (isinstance(config[key], bool)
                          or not isinstance(config[key], (int, float)) or config[key] < 0):
      _fail(f"{key}={config[key]!r} must be a number of seconds >= 0 (0: no stall watchdog)")
  if "max_steps" in config and (not isinstance(config.max_steps, int) or config.max_steps == 0
                                or config.max_steps < -1):
    _fail(f"max_steps={config.max_steps} must be -1 (run num_epochs) or a positive integer")
  if "lr_gamma" in config and not 0.0 < config.lr_gamma <= 1.0:
    _fail(f"lr_gamma={config.lr_gamma} must lie in (0, 1]")
  if "lr_milestones" in config:
    try:
      milestones = [float(m) for m in config.lr_milestones]
    except (TypeError, ValueError):
      _fail(f"lr_milestones={config.lr_milestones!r} must be a sequence of epochs")
    if milestones != sorted(milestones) or any(m <= 0 for m in milestones):
      _fail(f"lr_milestones={tuple(milestones)} must be increasing positive epochs")


# Coefficients with a documented range: (low, high, high included); None: unbounded.
_RANGES = {"dc_lambda": (0.0, None, True), "dc_lambda0": (0.0, None, True),
           "dc_decay": (0.0, 1.0, False), "nesterov_gamma": (0.0, 1.0, False),
           "discrepancy_decay": (0.0, 1.0, False), "staleness_strength": (0.0, None, True),
           "staleness_lr_power": (0.0, None, True), "peer_timeout_s": (0.0, None, True)}


def _validate_numbers(config) -> None:
  """Every number finite, the seed within 64 bits, the model's integer arguments >= 1 and
  the coefficients in their documented ranges (each one line)."""
  import math

  def numbers(node, prefix=""):
    for key in node.keys():
      value = node[key]
      if hasattr(value, "keys"):
        yield from numbers(value, f"{prefix}{key}.")
      elif isinstance(value, (list, tuple)):
        for x in value:
          yield f"{prefix}{key}", x, value
      else:
        yield f"{prefix}{key}", value, value
  for name, x, shown in numbers(config):
    if isinstance(x, float) and not math.isfinite(x):
      _fail(f"{name}={shown!r} must be a finite number".replace("=(", "=("))
  seed = config.seed
  if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
    _fail(f"seed={seed!r} must be an integer in [0, 2**63)")
  for key, value in dict(config.get("model_kwargs", {}) or {}).items():
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, int) and not isinstance(v, bool) and v < 1 for v in values):
      _fail(f"model_kwargs.{key}={value!r}: every size must be an integer >= 1")
  for key, (low, high, closed) in _RANGES.items():
    if key not in config or config[key] is None:
      continue
    v = config[key]
    if high is None and v < low:
      _fail(f"{key}={v} must be >= {low:g}")
    if high is not None and not (low <= v < high or (closed and v == high)):
      _fail(f"{key}={v} must lie in [{low:g}, {high:g}{']' if closed else ')'}")


def validate(config) -> None:
  """Raises ConfigError (one line: what is wrong, how to fix it) if `config` cannot work.

  Builds the model once to check the stages against it; the trainer, which needs the model
  anyway, calls `validate_fields` and `validate_model` itself instead.
  """
  validate_fields(config)
  validate_model(config, create_model(config))


def optimizer_hparams(config) -> dict:
  """The optimizer's parameters set in the config: b1, b2, eps (where not None) and
  `optimizer_kwargs`."""
  out = {k: config[k] for k in ("b1", "b2", "eps") if config.get(k) is not None}
  out.update(dict(config.get("optimizer_kwargs", {}) or {}))
  return out


def _validate_optimizer(config) -> None:
  """The optimizer's name and parameters, by building it once (nothing is allocated)."""
  try:
    make_optimizer(config.optimizer, 1e-3, momentum=config.momentum,
                   nesterov=config.nesterov, weight_decay=config.weight_decay,
                   peak_learning_rate=config.learning_rate, **optimizer_hparams(config))
  except (ValueError, TypeError) as e:
    _fail(str(e).splitlines()[0] + " (--config.optimizer, --config.b1/b2/eps, "
          "--config.optimizer_kwargs)")


def _validate_staleness(config) -> None:
  """The staleness method and its fields, as the method registry declares them."""
  problem = staleness_methods.config_problem(config)
  if problem:
    _fail(problem)


def _validate_telemetry(config) -> None:
  every = config.get("telemetry_every_steps", 0)
  if not isinstance(every, int) or every < 0:
    _fail(f"telemetry_every_steps={every} must be an integer >= 0 (0: off)")
  if every and config.num_replicas > 1:
    _fail("staleness telemetry measures one pipeline: use --config.num_replicas=1 or "
          "--config.telemetry_every_steps=0")
  if every and _process_count() > 1:
    _fail("staleness telemetry runs in single-process runs only: use "
          "--config.telemetry_every_steps=0 under several processes")


def num_classes(config) -> int:
  """The width of the model's head for the config's dataset: its classes, or a token
  dataset's vocabulary (the dataset's spec, `fdg_jax.data.kinds`)."""
  from fdg_jax.data import kinds
  return kinds.lookup(config.dataset).num_classes(config)


def create_model(config):
  """The config's model (ConfigError, one line, when its name or arguments are wrong)."""
  from fdg_jax import models
  try:
    return models.create(config.model, num_classes=num_classes(config),
                         **dict(config.get("model_kwargs", {}) or {}))
  except ValueError as e:
    _fail(str(e).splitlines()[0])


def validate_model(config, model) -> None:
  """Checks num_stages and split against `model` (a `fdg_jax.models` model)."""
  from fdg_jax import partition
  K = config.num_stages
  if K > model.num_blocks:
    _fail(f"num_stages={K} exceeds the {model.num_blocks} blocks of {config.model}; use at "
          f"most {model.num_blocks} stages or a deeper model")
  try:
    split = partition.parse_split(config.split)
  except ValueError as e:
    _fail(str(e))
  cost = config.get("split_cost", "flops")
  if cost not in partition.COSTS:
    _fail(f"split_cost={cost!r} is not one of {', '.join(partition.COSTS)}; "
          f"use --config.split_cost=flops")
  if isinstance(split, list):
    try:
      partition.check_boundaries(split, K, model.num_blocks)
    except ValueError as e:
      _fail(f"split={config.split!r}: {str(e).splitlines()[0]}")
  elif split == "paper" and K > 1 and K not in model.paper_splits:
    _fail(f"no paper split of {config.model} into {K} stages; use --config.split=balanced")
