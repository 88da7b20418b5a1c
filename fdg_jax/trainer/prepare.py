"""Setting a run up: from a config to the model, data, stages and schedule, once.

`setup` validates the config (one-line `ConfigError`s before any work), resolves
`staleness=auto` (`resolve_auto`), checks a resumed workdir's config, builds the model, the
data iterators (this process's rows of each batch), the stages at their boundaries and the
schedule with every stage's optimiser (`make_schedule`) on the devices `choose_placement`
picks, and returns them as a `Run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import fdg_jax
from fdg_jax import data as data_lib
from fdg_jax import engines, partition, plans, precision, runtime
from fdg_jax.config_check import (ConfigError, UserError, create_model, optimizer_hparams,
                                  validate_fields, validate_model)
from fdg_jax.optim import auto, methods
from fdg_jax.optim.factory import learning_rate_schedule, make_optimizer
from fdg_jax.trainer.checkpoints import CHECKPOINT_DIR
from fdg_jax.trainer.metrics import log

CONFIG_CHANGES_FILE = "config_changes.jsonl"  # fields changed on resume, old -> new


def loss_fn(logits, labels):
  """Mean softmax cross-entropy against integer labels."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def setup_cpu_devices(n: int) -> None:
  """Asks XLA:CPU for `n` devices (effective only before JAX's backends start).

  A launcher's JAX_NUM_CPU_DEVICES wins: it sizes every process of a multi-process run.
  """
  if n and n > 1 and "JAX_NUM_CPU_DEVICES" not in os.environ:
    with contextlib.suppress(Exception):
      jax.config.update("jax_num_cpu_devices", int(n))


def choose_placement(num_stages: int, num_replicas: int, engine: str = "auto") -> dict:
  """`devices=`, `mesh=` and `engine=` for the schedule, from the devices this process sees.

  Several replicas or processes (jax.distributed) take a ("data", "stage") mesh filled
  process by process (`runtime.make_mesh`): each replica's stages stay in one process where
  the processes have room for whole replicas, and a replica's stages spread over several
  processes otherwise (e.g. one device per process and K stages: a pipeline across
  processes, its messages crossing through collectives). Otherwise `engine`: "fused" runs
  every stage in one program on one device; "per_stage" puts stage k on device k (when
  there are K devices, else all on the first); "spmd" (FDG) runs the ticks as one program
  over K devices, one stage each (with replicas or processes, over the R x K mesh);
  "auto" is `fdg_jax.engines.preferred`'s choice (fused on CPU, per_stage on K
  accelerators; per_stage with replicas or processes).
  """
  devices = jax.devices()
  need = num_stages * num_replicas
  processes = jax.process_count()
  if num_replicas > 1 or processes > 1:
    if len(devices) < need:
      raise ConfigError(
          f"num_replicas={num_replicas} x num_stages={num_stages} needs {need} devices, "
          f"found {len(devices)}; lower num_replicas or set --config.num_cpu_devices={need}")
    mesh = runtime.make_mesh(num_replicas, num_stages)
    idle = sorted(set(range(processes)) - {d.process_index for d in mesh.devices.flat})
    if idle:
      raise ConfigError(
          f"processes {idle} hold none of the {need} devices of num_replicas={num_replicas} "
          f"x num_stages={num_stages}; raise num_replicas or num_stages, or start fewer "
          "processes (or give each fewer devices)")
    return {"mesh": mesh, "engine": "spmd" if engine == "spmd" else "per_stage"}
  if 1 < len(devices) < num_stages and engine == "per_stage":
    raise ConfigError(f"engine=per_stage puts stage k on device k: {num_stages} stages, found "
                      f"{len(devices)} devices; set --config.num_cpu_devices={num_stages} (or "
                      f"JAX_NUM_CPU_DEVICES) on CPU, lower num_stages to {len(devices)}, or use "
                      "--config.engine=fused")
  if engine == "auto":
    engine = engines.preferred(devices[0].platform, len(devices), num_stages)
    if 1 < len(devices) < num_stages:
      log(f"{len(devices)} devices for {num_stages} stages: every stage runs on "
          f"{devices[0]} ({engine} engine); give {num_stages} devices, or num_stages="
          f"{len(devices)}, for a stage per device")
  if engine == "spmd":
    if len(devices) < num_stages:
      raise ConfigError(f"engine=spmd puts each of the {num_stages} stages on its own device, "
                        f"found {len(devices)}; set --config.num_cpu_devices={num_stages} "
                        "on CPU, or use --config.engine=fused")
    return {"devices": devices[:num_stages], "engine": engine}
  if engine == "per_stage" and len(devices) >= num_stages:
    return {"devices": devices[:num_stages], "engine": engine}
  return {"devices": None, "engine": engine}


@dataclasses.dataclass
class Run:
  """What a training run is, decided once before the first tick (see `setup`).

  `stages` are the model's K stage functions at `boundaries` (block indices); `schedule`
  runs them; `params`/`model_states` are the initial per-stage values (None once consumed);
  `example` is one local batch of zeros (shapes for `schedule.init` and the run buffers).
  """
  config: ml_collections.ConfigDict
  workdir: str
  model: Any
  boundaries: tuple[int, ...]
  stages: list
  schedule: fdg_jax.Schedule
  learning_rate: optax.Schedule
  train_iter: Any  # data_lib.BatchIterator, or text.TextIterator for the text dataset
  test_iter: Callable[[], Any]  # a fresh pass over the test (validation) split
  batch_keys: tuple[str, str]  # the inputs' and the labels' keys in a batch
  steps_per_epoch: int
  total_steps: int
  example: tuple[np.ndarray, np.ndarray]
  params: list | None
  model_states: list | None
  commit_config: Callable[[], None] = lambda: None  # writes config.json (or the changes)


def _feeding(placement) -> dict:
  """Which rows of every training batch this process reads: its block among the processes
  feeding stage 0 (a process that feeds nothing reads none: `next_batches`)."""
  feeder = placement.feeder()
  index, count = feeder if feeder is not None else (0, 1)
  return dict(process_index=index, process_count=count)


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates `config` and builds everything the run needs, each piece once.

  Raises ConfigError or DatasetNotFoundError (one line) before any training work.
  """
  config = resolve_auto(config)
  validate_fields(config)
  setup_cpu_devices(config.num_cpu_devices)
  os.makedirs(workdir, exist_ok=True)
  commit_config = _check_config(config, workdir)
  model = create_model(config)
  validate_model(config, model)

  placement = choose_placement(config.num_stages, config.num_replicas,
                               config.get("engine", "auto"))
  feeding = _feeding(fdg_jax.Placement.create(config.num_stages, devices=placement.get(
      "devices"), mesh=placement.get("mesh")))
  train_iter, test_iter, shape, dtype, keys = _data(config, feeding)
  steps_per_epoch = train_iter.steps_per_epoch
  total_steps = config.num_epochs * steps_per_epoch
  if config.max_steps > 0:
    total_steps = min(total_steps, config.max_steps)

  x1 = jnp.zeros((1,) + shape, dtype)
  cost = config.get("split_cost", "flops")
  bounds = partition.boundaries(model, config.num_stages, partition.parse_split(config.split),
                                example_input=x1 if cost != "time" else jnp.zeros(
                                    (max(1, config.batch_size // max(1, config.get(
                                        "num_replicas", 1))),) + shape, dtype), cost=cost)
  stages = partition.stages_from_boundaries(model, bounds)
  params, model_states = fdg_jax.init_stages(stages, jax.random.PRNGKey(config.seed), x1)
  compute_dtype = precision.DTYPES[config.get("dtype", "float32")]
  stages = [precision.mixed_precision(s, compute_dtype) for s in stages]
  schedule, lr = make_schedule(config, stages, steps_per_epoch, placement)
  rows = _local_rows(schedule, config.batch_size, feeding)
  label_shape = shape if data_lib.kinds.lookup(config.dataset).kind == "tokens" else ()
  example = (np.zeros((rows,) + shape, dtype), np.zeros((rows,) + label_shape, np.int32))
  return Run(config=config, workdir=workdir, model=model, boundaries=tuple(bounds),
             stages=stages, schedule=schedule, learning_rate=lr, train_iter=train_iter,
             test_iter=test_iter, batch_keys=keys, steps_per_epoch=steps_per_epoch,
             total_steps=total_steps, example=example, params=params,
             model_states=model_states, commit_config=commit_config)


def auto_fields(config) -> tuple[dict, str]:
  """What `staleness=auto` sets for `config` (`fdg_jax.optim.auto.recommend` on its
  optimiser, schedule, K, momentum, learning rate, ...): (config fields, the start line)."""
  return auto.recommend(
      config.optimizer, config.algorithm, num_stages=config.num_stages,
      momentum=config.momentum, nesterov=config.nesterov, beta=config.beta,
      backward=config.backward, learning_rate=config.learning_rate,
      num_epochs=config.num_epochs)


def resolve_auto(config):
  """`config` with `staleness="auto"` replaced by the time-to-quality study's held-out choice
  for its optimiser, schedule and K (`fdg_jax.optim.auto.recommend`: nothing outside the
  cells the study ran), said in one line; else `config` itself."""
  if config.get("staleness", "none") != "auto":
    return config
  fields, line = auto_fields(config)
  resolved = config.copy_and_resolve_references()
  for key, value in fields.items():
    resolved[key] = value
  if jax.process_index() == 0:
    log(line)
  return resolved


def _data(config, feeding: dict):
  """(training iterator, test iterator factory, input shape, input dtype, batch keys), from
  the dataset's spec (`fdg_jax.data.kinds`).

  `feeding` (process_index, process_count) picks this process's rows of every training
  batch; every process reads whole test batches (see `evaluate`).
  """
  spec = data_lib.kinds.lookup(config.dataset)
  splits = spec.load(config, feeding)
  shape, dtype = spec.example(config)
  n_train = splits.size(splits.train)
  if spec.kind == "images":
    for split, ds in (("train", splits.train), ("test", splits.test)):
      _check_labels(config.dataset, split, ds, spec.num_classes(config))
  if config.batch_size > n_train:
    raise ConfigError(f"batch_size={config.batch_size} exceeds the {n_train} {splits.unit} of "
                      f"{config.dataset}; lower --config.batch_size")
  # An evaluation batch above the test split would be padded to its size: one batch of
  # the split (a multiple of the replicas) does the same work.
  n_test = splits.size(splits.test)
  R = config.num_replicas
  eval_batch = min(config.eval_batch_size, max(R, -(-n_test // R) * R))
  test_iter = lambda: splits.make(splits.test, eval_batch, False, feeding)
  return (splits.make(splits.train, config.batch_size, True, feeding), test_iter,
          tuple(shape), dtype, spec.keys)


def _check_labels(name: str, split: str, ds, classes: int) -> None:
  """Labels of an in-memory split lie in [0, classes): one outside would train silently
  (optax takes -1 as the last class) or give a NaN loss."""
  labels = getattr(ds, "labels", None)
  if labels is None or not len(labels):
    return
  lo, hi = int(np.min(labels)), int(np.max(labels))
  if lo < 0 or hi >= classes:
    bad = lo if lo < 0 else hi
    raise UserError(f"{name} {split}: label {bad} lies outside [0, {classes}); fix the "
                    "dataset's labels (or its registered num_classes)")


def _local_rows(schedule, batch_size: int, feeding: dict) -> int:
  """The rows of each batch this process passes (ConfigError if processes feed unevenly)."""
  if schedule.placement.feeder() is None:
    return batch_size  # whole batches, not read
  local = schedule.placement.local_batch_slice(batch_size)
  rows = local.stop - local.start
  index, count = feeding["process_index"], feeding["process_count"]
  if batch_size % count or rows != batch_size // count or local.start != index * rows:
    raise ConfigError(f"this process feeds {rows} rows of each batch of {batch_size}; use "
                      "as many replicas per process on every process holding stage 0, and a "
                      "batch_size they divide")
  return rows


def make_schedule(config, stages, steps_per_epoch: int, placement: dict | None = None):
  """The config's schedule over `stages`, and its learning-rate schedule.

  `placement`: `choose_placement`'s answer (computed here when None)."""
  lr = learning_rate_schedule(
      config.lr_schedule, config.learning_rate, steps_per_epoch=steps_per_epoch,
      num_epochs=config.num_epochs, warmup_epochs=config.warmup_epochs,
      milestones=tuple(config.lr_milestones), gamma=config.lr_gamma)
  base = make_optimizer(config.optimizer, lr, momentum=config.momentum,
                        nesterov=config.nesterov, weight_decay=config.weight_decay,
                        peak_learning_rate=config.learning_rate, **optimizer_hparams(config))
  hparams = staleness_hparams(config, steps_per_epoch)

  def stage_optimizer(k, d):  # stage k's optimizer, given its delay d
    del k
    return methods.stage_optimizer(
        config.get("staleness", "none"), base, delay=d, learning_rate=lr,
        momentum=config.momentum, weight_decay=config.weight_decay, hparams=hparams,
        optimizer=config.optimizer, nesterov=config.nesterov)

  kwargs = dict(placement or choose_placement(config.num_stages, config.num_replicas,
                                              config.get("engine", "auto")))
  spec = plans.spec(config.algorithm)
  # The schedule's own options (its registry spec), from the config fields of those names.
  kwargs.update({option: config.get(option, default) for option, default in
                 (("beta", 1.0), ("shrink_at", "gradient"), ("backward", "stash"),
                  ("microbatches", 1)) if option in spec.options})
  if spec.microbatched:  # a synchronous pipeline: no mesh, no telemetry, no gate
    kwargs = {k: v for k, v in kwargs.items() if k in ("devices", "engine", *spec.options)}
  else:
    kwargs["telemetry"] = config.get("telemetry_every_steps", 0) > 0
    if config.get("gate", "auto") != "auto":
      kwargs["gate"] = config.gate
  loss = loss_fn if config.get("dtype", "float32") == "float32" else precision.float32_loss(
      loss_fn)
  return fdg_jax.create(config.algorithm, stages, loss, stage_optimizer, **kwargs), lr


def staleness_hparams(config, steps_per_epoch: int) -> dict:
  """The hyperparameters of the config's staleness method(s) ("a+b" combines them), from
  the config fields the method registry names (`fdg_jax.optim.methods`)."""
  return methods.config_hparams(config, steps_per_epoch)


_IDENTITY_FIELDS = ("algorithm", "num_stages", "model", "model_kwargs", "dataset",
                    "batch_size", "seed", "split", "split_cost", "backward", "beta", "num_replicas",
                    "staleness", "dtype", "optimizer", "shrink_at")


# The identity fields that runs of older versions lack, as those runs had them.
_DEFAULTS = {"staleness": "none", "dtype": "float32", "shrink_at": "gradient",
             "split_cost": "flops"}


def _check_config(config, workdir: str) -> Callable[[], None]:
  """Checks that a resumed run was started with the same method (ConfigError otherwise);
  returns what writes config.json (a fresh run) or the changed fields' row in
  config_changes.jsonl (a resume), called once the checkpoint has restored: a resume that
  fails leaves the workdir's files as they were."""
  path = os.path.join(workdir, "config.json")
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path) and os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
    with open(path) as f:
      saved = json.load(f)
    for key in _IDENTITY_FIELDS:
      if key not in saved and key not in _DEFAULTS:
        continue
      if saved.get(key, _DEFAULTS.get(key)) != current.get(key, _DEFAULTS.get(key)):
        raise ConfigError(
            f"{workdir} holds a run with {key}={saved.get(key)!r}, not {current.get(key)!r}; "
            "use a new --workdir or the original config")
    if bool(saved.get("telemetry_every_steps", 0)) != bool(current.get("telemetry_every_steps", 0)):
      raise ConfigError(
          f"{workdir} holds a run with telemetry_every_steps="
          f"{saved.get('telemetry_every_steps', 0)}: telemetry on or off changes what a "
          "checkpoint holds; keep it on (any N > 0) or off as the run started")
    # Fields that may change on a resume, except where the change adds or drops a part of
    # the optimiser (and so of what its checkpoint holds): sgd's momentum buffer, the
    # decayed-weights step of sgd and adam.
    toggles = {"momentum": ("sgd",), "weight_decay": ("sgd", "adam")}
    for key, optimizers in toggles.items():
      old, new = saved.get(key), current.get(key)
      if current.get("optimizer") in optimizers and bool(old) != bool(new):
        raise ConfigError(
            f"{workdir} holds a run with {key}={old!r}: {key}={new!r} turns that part of the "
            f"{current.get('optimizer')} optimiser {'off' if old else 'on'}, which changes what "
            f"its checkpoint holds; resume with any {key} {'> 0' if old else '= 0'}, or use a "
            "new --workdir")
    changed = {key: [saved.get(key), current.get(key)]
               for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)}

    def record_changes():  # keep the config the run was started with (config.json)
      if changed and jax.process_index() == 0:
        log(f"resuming {workdir} with a changed config: " + ", ".join(
            f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()))
        with open(os.path.join(workdir, CONFIG_CHANGES_FILE), "a") as f:
          f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "changes": changed}) + "\n")
    return record_changes

  def write_config():
    if jax.process_index() == 0:
      tmp = path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(current, f, indent=2, sort_keys=True)
      os.replace(tmp, path)
  return write_config
