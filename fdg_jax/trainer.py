"""The training loop: `train_and_evaluate(config, workdir)`.

One tick of the chosen schedule per batch; evaluation every `eval_every_epochs`; orbax
checkpoints that hold everything needed for an exact resume (every stage's params, model
state, optimizer state and stash, the messages in flight, the tick, the data position).
Re-running with the same workdir resumes from the latest checkpoint.

User errors (a bad config, a missing dataset, a diverged run) raise `UserError` subclasses
whose message is one line; `train.py` prints it and exits non-zero without a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import fdg_jax
from fdg_jax import data as data_lib
from fdg_jax import models, partition, plans, precision, runtime, staleness
from fdg_jax.runtime import arrays as runtime_arrays
from fdg_jax.config_check import (TEXT_DATASET, ConfigError, UserError, create_model,
                                  optimizer_hparams, validate, validate_fields, validate_model)
from fdg_jax.optim import learning_rate_schedule, make_optimizer
from fdg_jax.runtime.watchdog import StallWatchdog

CHECKPOINT_DIR = "checkpoints"
STALL_STACKS = "stall_stacks.txt"  # where a stalled run writes the stacks of its threads
METRICS_FILE = "metrics.jsonl"
CONFIG_CHANGES_FILE = "config_changes.jsonl"  # fields changed on resume, old -> new


class DivergedError(UserError):
  """The loss became NaN or infinite."""


class CheckpointError(UserError):
  """No checkpoint of the workdir can be restored."""


class Interrupted(UserError):
  """SIGINT/SIGTERM: a checkpoint was saved and the run can be resumed."""

  def __init__(self, msg: str, signum: int):
    super().__init__(msg)
    self.signum = signum


def loss_fn(logits, labels):
  """Mean softmax cross-entropy against integer labels."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ------------------------------------------------------------------------------ set-up
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
  "auto" is fused on CPU, where forced devices share the host's cores (so stages apart gain
  nothing) and one program per call costs far less host time, and per_stage on K
  accelerators (per_stage with replicas or processes).
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
  if engine == "auto":
    apart = devices[0].platform != "cpu" and len(devices) >= num_stages > 1
    engine = "per_stage" if apart else "fused"
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
  _check_or_write_config(config, workdir)
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
  bounds = partition.boundaries(model, config.num_stages, partition.parse_split(config.split),
                                example_input=x1)
  stages = partition.stages_from_boundaries(model, bounds)
  params, model_states = fdg_jax.init_stages(stages, jax.random.PRNGKey(config.seed), x1)
  compute_dtype = precision.DTYPES[config.get("dtype", "float32")]
  stages = [precision.mixed_precision(s, compute_dtype) for s in stages]
  schedule, lr = make_schedule(config, stages, steps_per_epoch, placement)
  rows = _local_rows(schedule, config.batch_size, feeding)
  label_shape = shape if config.dataset == TEXT_DATASET else ()
  example = (np.zeros((rows,) + shape, dtype), np.zeros((rows,) + label_shape, np.int32))
  return Run(config=config, workdir=workdir, model=model, boundaries=tuple(bounds),
             stages=stages, schedule=schedule, learning_rate=lr, train_iter=train_iter,
             test_iter=test_iter, batch_keys=keys, steps_per_epoch=steps_per_epoch,
             total_steps=total_steps, example=example, params=params,
             model_states=model_states)


def resolve_auto(config):
  """`config` with `staleness="auto"` replaced by the study's choice for its optimiser,
  schedule, K and momentum (`staleness.recommend`: nothing outside what the study covered),
  said in one line; else `config` itself. Where the optimiser is switched (the Adam family to
  rotated Adam), the line gives both optimisers' state for the config's model, built with
  `jax.eval_shape` (nothing allocated)."""
  if config.get("staleness", "none") != "auto":
    return config
  fields, line = staleness.recommend(
      config.optimizer, config.algorithm, num_stages=config.num_stages,
      momentum=config.momentum, nesterov=config.nesterov, beta=config.beta,
      backward=config.backward, hparams=tuple(optimizer_hparams(config)))
  resolved = config.copy_and_resolve_references()
  for key, value in fields.items():
    resolved[key] = value

  def state_bytes(c, params) -> int:
    tx = make_optimizer(c.optimizer, c.learning_rate, momentum=c.momentum, nesterov=c.nesterov,
                        weight_decay=c.weight_decay, peak_learning_rate=c.learning_rate,
                        **optimizer_hparams(c))
    return staleness.tree_bytes(jax.eval_shape(tx.init, params))

  if jax.process_index() == 0:
    if resolved.optimizer != config.optimizer:
      validate_fields(resolved)  # the one-line errors setup would give, before sizing
      model = create_model(resolved)
      shape, dtype = (((config.seq_len,), jnp.int32) if config.dataset == TEXT_DATASET else
                      (tuple(data_lib.get_spec(config.dataset).image_shape), jnp.float32))
      whole = partition.stages_from_boundaries(model, [])[0]  # every stage's params at once
      params, _ = jax.eval_shape(lambda x: whole.init(jax.random.PRNGKey(0), x),
                                 jax.ShapeDtypeStruct((1, *shape), dtype))
      line += "; " + staleness.state_memory(
          config.optimizer, state_bytes(config, params), resolved.optimizer,
          state_bytes(resolved, params), staleness.tree_bytes(params))
    _log(line)
  return resolved


def _data(config, feeding: dict):
  """(training iterator, test iterator factory, input shape, input dtype, batch keys).

  `feeding` (process_index, process_count) picks this process's rows of every training
  batch; every process reads whole test batches (see `evaluate`).
  """
  if config.dataset == TEXT_DATASET:
    from fdg_jax.data import text
    kwargs = dict(seq_len=config.seq_len, max_bytes=config.get("text_max_bytes", 0) or None)
    train_ds, test_ds = text.load_text("train", **kwargs), text.load_text("validation", **kwargs)
    make = lambda ds, bs, train: text.TextIterator(ds, bs, train=train, seed=config.seed,
                                                   **(feeding if train else {}))
    shape, dtype, keys = (config.seq_len,), np.int32, ("tokens", "targets")
    sizes = (train_ds.num_windows, "windows")
  else:
    data_dir = config.data_dir or None
    train_ds = data_lib.load(config.dataset, "train", data_dir)
    test_ds = data_lib.load(config.dataset, "test", data_dir)
    workers = config.get("data_workers", 0)
    make = lambda ds, bs, train: data_lib.BatchIterator(
        ds, bs, train=train, seed=config.seed if train else 0, drop_remainder=train,
        workers=workers if train else 0, **(feeding if train else {}))
    shape, dtype, keys = tuple(train_ds.image_shape), np.float32, ("image", "label")
    sizes = (train_ds.num_examples, "training examples")
  if config.batch_size > sizes[0]:
    raise ConfigError(f"batch_size={config.batch_size} exceeds the {sizes[0]} {sizes[1]} of "
                      f"{config.dataset}; lower --config.batch_size")
  test_iter = lambda: make(test_ds, config.eval_batch_size, False)
  return make(train_ds, config.batch_size, True), test_iter, shape, dtype, keys


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
    return staleness.stage_optimizer(
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
  """The hyperparameters of the config's staleness method(s) ("a+b" combines them)."""
  parts = set(config.get("staleness", "none").split("+"))
  out: dict = {}
  if "lr_by_delay" in parts:
    ramp = config.staleness_ramp_epochs
    out["ramp_steps"] = None if ramp < 0 else int(round(ramp * steps_per_epoch))
    out["power"] = config.get("staleness_lr_power", 1.0)
  if "weight_prediction" in parts:
    out["horizon"] = None if config.staleness_horizon < 0 else config.staleness_horizon
  if "dc" in parts:
    out.update(lam=config.dc_lambda, adaptive=config.dc_adaptive, decay=config.dc_decay,
               lam0=config.dc_lambda0)
  if "nesterov_delay" in parts:
    out["gamma"] = config.nesterov_gamma
  if "error_feedback" in parts:
    out["strength"] = config.get("staleness_strength", 1.0)
  if "discrepancy_correction" in parts:
    out["discrepancy_decay"] = config.get("discrepancy_decay", 0.9)
  return out


# ------------------------------------------------------------------------------ checkpoints
class Checkpointer:
  """Orbax CheckpointManager over {schedule state, data position, progress}."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    if jax.process_count() > 1:
      runtime_arrays.single_replica_writes()
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, progress: dict) -> None:
    ocp = self._ocp
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(runtime_arrays.to_checkpoint(state)),
        data=ocp.args.JsonSave(data_state),
        progress=ocp.args.JsonSave(progress)), force=True)
    self.manager.wait_until_finished()

  def restore_latest(self, target_state):
    """Restores the newest checkpoint that restores; None when there is none at all.

    A checkpoint that fails to restore (truncated or corrupt files) is reported in one line
    and skipped for the one before it; once one restores, the skipped ones are moved aside
    to `<workdir>/corrupt_checkpoints/` (the run will write those steps again). If none
    restores, CheckpointError, and nothing is moved or deleted.

    Returns:
      (step, state, data position, progress) or None.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    skipped = []
    for step in steps:
      try:
        with _quiet_unraisable():
          restored = self.restore(step, target_state)
      except Exception as e:  # noqa: BLE001  any failure to read means: try an older one
        first = (str(e).strip().splitlines() or [""])[0][:200]
        _log(f"checkpoint step {step} in {self.directory} does not restore "
             f"({type(e).__name__}: {first}); trying the one before it")
        skipped.append(step)
        continue
      self._set_aside(skipped)
      return (step, *restored)
    if steps:
      raise CheckpointError(
          f"no checkpoint in {self.directory} restores (steps {steps}): corrupt, or written "
          "with another state layout (another config, or an fdg_jax version before a change "
          "of the stash; see the lines above); nothing was deleted: resume with what wrote "
          "them, move that folder away to start over, or restore it from a backup")
    return None

  def _set_aside(self, steps) -> None:
    """Moves the checkpoints of `steps` out of the manager's folder (kept, not deleted)."""
    if not steps:
      return
    aside = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(aside, f"{step}_{int(time.time())}")
        if os.path.exists(src):
          os.replace(src, dst)
          _log(f"moved the unreadable checkpoint of step {step} to {dst}")
    self.manager.reload()

  def restore(self, step: int, target_state):
    ocp = self._ocp
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(runtime_arrays.checkpoint_target(target_state)),
        data=ocp.args.JsonRestore(),
        progress=ocp.args.JsonRestore()))
    state = runtime_arrays.from_checkpoint(restored["state"], target_state)
    return state, restored["data"], restored["progress"]

  def close(self):
    self.manager.close()


# ------------------------------------------------------------------------------ evaluation
def evaluate(schedule, state, iterator, keys=("image", "label")) -> dict:
  """Eval-mode loss and accuracy over one pass of `iterator` (padded rows masked out).

  Labels may carry extra axes (a language model's [B, T] targets): every position counts,
  and the loss is the mean per position (tokens), with `test_perplexity` = exp(loss).
  `test_loss_se`: the standard error of the mean loss over the examples (a sequence counts
  once, its loss the mean over its tokens), for choosing between runs on held-out data.
  With several processes every process reads whole test batches and feeds stage 0 its
  rows of them; the logits are fetched to every process, so that each computes the
  metrics of the whole test set.
  """
  total_loss = correct = count = 0.0
  rows = row_sum = row_sq = 0.0  # per example (a sequence: its mean per token) losses
  per_token = False
  for batch in iterator:
    x = batch[keys[0]]
    logits = runtime_arrays.fetch(schedule.evaluate(state, x[_fed_rows(schedule, len(x))]))
    labels = np.asarray(batch[keys[1]])
    mask = batch.get("mask", np.ones(len(labels), np.float32))
    per_token = labels.ndim > 1
    mask = np.broadcast_to(np.asarray(mask, np.float64).reshape(
        (-1,) + (1,) * (labels.ndim - 1)), labels.shape).reshape(-1)
    logits = np.asarray(logits, np.float64).reshape(labels.size, -1)
    labels = labels.reshape(-1)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(labels)), labels]
    total_loss += float((nll * mask).sum())
    per_row = nll.reshape(len(batch[keys[1]]), -1).mean(-1)
    real = np.asarray(batch.get("mask", np.ones(len(per_row))), np.float64)
    rows += float(real.sum())
    row_sum += float((per_row * real).sum())
    row_sq += float((per_row ** 2 * real).sum())
    correct += float(((logits.argmax(-1) == labels) * mask).sum())
    count += float(mask.sum())
  out = {"test_loss": total_loss / max(count, 1), "test_accuracy": correct / max(count, 1)}
  if rows > 1:  # the standard error of the mean loss over examples (sequences)
    mean = row_sum / rows
    out["test_loss_se"] = float(np.sqrt(max(row_sq / rows - mean ** 2, 0.0) / (rows - 1)))
  if per_token:
    out["test_perplexity"] = float(np.exp(out["test_loss"]))
  return out


def _fed_rows(schedule, batch_size: int) -> slice:
  """The rows of a whole batch this process passes to the schedule (all if it feeds none:
  they give the shapes only)."""
  placement = schedule.placement
  if placement.feeder() is None:
    return slice(None)
  return placement.local_batch_slice(batch_size)


_FINITE = jax.jit(lambda tree: jnp.all(jnp.stack(
    [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
     if jnp.issubdtype(a.dtype, jnp.inexact)] + [jnp.bool_(True)])))


def _finite_flags(trees) -> list[bool]:
  """Whether each tree's floating arrays are all finite (each tree on one stage's devices);
  one host read for all of them."""
  return [bool(f) for f in runtime_arrays.fetch([_FINITE(t) for t in trees])]


def _nonfinite_stage(schedule, state) -> int | None:
  """The first stage whose parameters hold a NaN or infinity, or None."""
  flags = _finite_flags(schedule.params(state))
  return next((k for k, ok in enumerate(flags) if not ok), None)


def _nonfinite_part(schedule, state) -> str | None:
  """Which part of the schedule state is not finite (parameters first), or None."""
  k = _nonfinite_stage(schedule, state)
  if k is not None:
    return f"stage {k}'s parameters"
  boxes = [box for box in (state.get("inbox") or []) if jax.tree.leaves(box)]
  flags = _finite_flags(list(state["stages"]) + boxes)
  K = len(state["stages"])
  k = next((k for k, ok in enumerate(flags[:K]) if not ok), None)
  if k is not None:
    return f"stage {k}'s optimizer state or stash"
  if not all(flags[K:]):
    return "a message between stages"
  return None


@contextlib.contextmanager
def _quiet_unraisable():
  """Silences the leftovers of a failed orbax restore (its exception says what failed).

  A restore that fails leaves orbax's pending read coroutines to be garbage-collected, now
  or at exit, and Python prints each one's traceback. From the first restore on, the
  process's unraisable hook drops the reports of orbax coroutines (and passes the rest on).
  """
  # The reads of a failed restore still in flight finish on tensorstore's threads, whose
  # callbacks find orbax's event loop closed and print tracebacks straight to file
  # descriptor 2: hold it on /dev/null while restoring, and give them a moment to land.
  sys.stderr.flush()
  saved_fd = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  failed = True
  if not getattr(sys.unraisablehook, "_drops_orbax_reads", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      code = getattr(unraisable.object, "cr_code", None)
      if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return
      previous(unraisable)
    hook._drops_orbax_reads = True
    sys.unraisablehook = hook
    # ... and their tasks' "exception was never retrieved", logged by asyncio.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  try:
    yield
    failed = False
  finally:
    if failed:
      time.sleep(0.5)
    gc.collect()
    sys.stderr.flush()
    os.dup2(saved_fd, 2)
    os.close(saved_fd)
    os.close(devnull)


@contextlib.contextmanager
def _stop_on_signals():
  """Turns SIGINT/SIGTERM into a flag checked between ticks (main thread only)."""
  flag: dict[str, Any] = {"signum": None}
  previous: dict = {}

  def handler(signum, frame):
    del frame
    flag["signum"] = signum
    signal.signal(signum, previous.get(signum, signal.SIG_DFL))  # a second signal is not caught

  try:
    for s in (signal.SIGINT, signal.SIGTERM):
      previous[s] = signal.signal(s, handler)
  except ValueError:  # not the main thread: no signal handling
    previous = {}
  try:
    yield flag
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


class _MetricWriter:
  """metrics.jsonl (one object per evaluation) and TensorBoard scalars."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb = None
    self.enabled = jax.process_index() == 0  # one writer in a multi-process run
    if not self.enabled:
      return
    # Drop records written after the checkpoint we resume from: they will be recomputed.
    if os.path.exists(self.path):
      with open(self.path) as f:
        keep = [l for l in f if l.strip() and json.loads(l)["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(keep)
    try:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    except ImportError:  # TensorBoard files are optional
      self.tb = None

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb is not None:
      for k, v in record.items():
        if k not in ("step", "epoch") and isinstance(v, (int, float)):
          self.tb.add_scalar(k, v, record["step"])
        elif isinstance(v, list):  # per-stage values (telemetry): one scalar per stage
          for i, x in enumerate(v):
            if isinstance(x, (int, float)):
              self.tb.add_scalar(f"{k}/stage_{i}", x, record["step"])
      self.tb.flush()

  def close(self):
    if self.tb is not None:
      self.tb.close()


# ------------------------------------------------------------------------------ the loop
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and evaluates.

  Returns:
    a dict with the last evaluation's metrics, `steps`, `wall_time` and `params` (host copies
    of the K per-stage parameter pytrees).

  Raises:
    ConfigError, DatasetNotFoundError, DivergedError, Interrupted (all one-line messages).
  """
  run = setup(config, workdir)
  holder: dict = {}
  watchdog = StallWatchdog(config.get("stall_timeout_s", 600),
                           config.get("stall_first_tick_s", 1800),
                           os.path.join(workdir, STALL_STACKS),
                           lambda: _describe_checkpoint(holder.get("loop"), workdir))
  watchdog.start(None)
  try:
    loop = holder["loop"] = TrainingLoop(run)
    watchdog.resumed(loop.last_good)  # the first tick still compiles: its allowance holds
    try:
      with _stop_on_signals() as stop:
        evaluated = False
        while loop.step < run.total_steps:
          loop.train_until_next_boundary()
          watchdog.dispatched(loop.step, loop.pending[-1]["loss"])
          if loop.at(config.log_every_steps):
            loop.log_progress()
          if loop.telemetry_every and loop.at(loop.telemetry_every):
            loop.measure_staleness()
          if loop.evaluation_due():
            if not evaluated:  # the first evaluation compiles its program
              watchdog.allow_compile()
            loop.evaluate_and_record()
            evaluated = True
            watchdog.beat()
          loop.end_epoch_if_done()
          if loop.at(config.checkpoint_every_steps) or loop.step == run.total_steps:
            loop.save()
            watchdog.beat()
          loop.stop_if_signalled(stop)
        loop.flush_losses()
    finally:
      loop.close()
    if not loop.final:
      watchdog.allow_compile()
    return loop.result()
  finally:
    watchdog.close()


def _describe_checkpoint(loop, workdir: str) -> str:
  """The newest-checkpoint part of a stall's line."""
  if loop is not None and loop.last_good is not None:
    return f"newest checkpoint: step {loop.last_good} in {loop.ckpt.directory}"
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  return f"no checkpoint in {directory} yet"


class TrainingLoop:
  """The state of a run between ticks, and the steps the loop takes on it.

  Ticks run in `schedule.run` calls of up to `ticks_per_call` ticks, cut at every log,
  evaluation and checkpoint step, so that the loop acts exactly where an uninterrupted
  one-tick-at-a-time loop would. Losses stay on the device until a log step.
  """

  def __init__(self, run: Run):
    self.run = run
    self.config = config = run.config
    self.schedule = run.schedule
    self.ckpt = Checkpointer(os.path.join(run.workdir, CHECKPOINT_DIR))
    self.progress = {"wall_time": 0.0, "train_loss_sum": 0.0, "train_acc_sum": 0.0,
                     "train_count": 0}
    self.state, start = self._restore_or_init()
    self.last_good = start
    self.step = 0 if start is None else int(start)
    self.writer = _MetricWriter(run.workdir, self.step)
    self.pending: list = []  # metrics of `run` calls whose losses are not read yet
    self.ticks_per_call = config.get("ticks_per_call", 1)
    self.telemetry_every = config.get("telemetry_every_steps", 0)
    self.telemetry: dict = {}  # the staleness measured at this step, for its metrics row
    self.run_start = time.time() - self.progress["wall_time"]
    self.final: dict = {}
    self.bar = None
    self._start_epoch_clock()

  # ---- start -----------------------------------------------------------------------------
  def _restore_or_init(self):
    """The schedule state to start from: the newest checkpoint that restores, else fresh."""
    run = self.run
    state = run.schedule.init(run.params, run.model_states,
                              rng=jax.random.PRNGKey(self.config.seed + 1),
                              example_batch=run.example)
    run.params = run.model_states = None
    if self.ckpt.latest_step() is None:
      return state, None
    # Restore into shapes and shardings only, freeing the freshly built state first, so
    # that a resume does not hold two copies of the parameters and stashes.
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array) else a, state)
    del state
    start, state, data_state, self.progress = self.ckpt.restore_latest(target)
    state["tick"] = np.asarray(state["tick"], np.int64)
    run.train_iter.set_state(data_state)
    _log(f"resumed from step {start} in {run.workdir}")
    return state, start

  def _start_epoch_clock(self):
    self.epoch_start_time = time.time()
    self.epoch_steps = 0
    self.paused = 0.0  # seconds of checkpointing within the current epoch (not training)

  # ---- training ----------------------------------------------------------------------------
  def at(self, every: int) -> bool:
    return self.step % every == 0

  def ticks_to_next_boundary(self) -> int:
    """Ticks for the next `run` call: up to ticks_per_call, ending at the next log,
    evaluation or checkpoint step (where the loop acts between calls)."""
    c, step = self.config, self.step
    every = [c.log_every_steps, c.checkpoint_every_steps, self.run.steps_per_epoch]
    if c.get("eval_every_steps", 0) > 0:
      every.append(c.eval_every_steps)
    if self.telemetry_every:
      every.append(self.telemetry_every)
    return min([self.ticks_per_call, self.run.total_steps - step]
               + [n - step % n for n in every])

  def next_batches(self, num_ticks: int):
    """`num_ticks` training batches in buffers of length ticks_per_call (one compiled
    program whatever num_ticks); fresh buffers every call, as a device may still read
    (or, on CPU, alias) the last ones. A process that holds none of stage 0's devices
    passes zeros of the batch's shape and reads no data (process 0 always feeds, and
    its data position is the one checkpointed)."""
    x, y = self.run.example
    xs = np.zeros((self.ticks_per_call,) + x.shape, x.dtype)
    ys = np.zeros((self.ticks_per_call,) + y.shape, y.dtype)
    if self.schedule.placement.feeder() is None:
      return xs, ys
    for i in range(num_ticks):
      row = next(self.run.train_iter)
      xs[i], ys[i] = row[self.run.batch_keys[0]], row[self.run.batch_keys[1]]
    return xs, ys

  def train_until_next_boundary(self) -> None:
    if self.bar is None and self.config.progress_bar:
      self.bar = _progress_bar(self.config, self.run.steps_per_epoch, self.step)
    num_ticks = self.ticks_to_next_boundary()
    self.state, metrics = self.schedule.run(self.state, self.next_batches(num_ticks),
                                            num_ticks)
    self.pending.append(metrics)
    self.step += num_ticks
    self.epoch_steps += num_ticks
    if self.bar is not None:
      self.bar.update(num_ticks)

  def flush_losses(self) -> None:
    """Moves the losses of the last calls to the host and stops on a non-finite one."""
    if not self.pending:
      return
    pending, self.pending = self.pending, []
    got = runtime_arrays.fetch([(m["loss"], m["accuracy"], m["valid"]) for m in pending])
    ticks = np.concatenate([np.asarray(m["tick"]) for m in pending])
    valid = np.concatenate([np.asarray(v, bool).reshape(-1) for _, _, v in got])
    losses = np.concatenate([np.asarray(l, np.float64).reshape(-1) for l, _, _ in got])[valid]
    accs = np.concatenate([np.asarray(a, np.float64).reshape(-1) for _, a, _ in got])[valid]
    if not np.all(np.isfinite(losses)):
      bad = int(ticks[valid][~np.isfinite(losses)][0]) + 1
      k = _nonfinite_stage(self.schedule, self.state)
      where = f"stage {k}'s parameters" if k is not None else "the loss"
      self._diverged(f"non-finite loss at step {bad} ({where} non-finite by step "
                     f"{self.step})")
    self.progress["train_loss_sum"] += float(losses.sum())
    self.progress["train_acc_sum"] += float(accs.sum())
    self.progress["train_count"] += int(losses.size)

  def _diverged(self, what: str):
    saved = (f"last good checkpoint: step {self.last_good} in {self.ckpt.directory}"
             if self.last_good is not None else "no checkpoint was saved yet")
    raise DivergedError(f"training diverged: {what}; {saved}; lower --config.learning_rate "
                        "or --config.momentum, or try --config.beta<1")

  # ---- reporting ---------------------------------------------------------------------------
  def log_progress(self) -> None:
    self.flush_losses()
    p = self.progress
    if self.bar is not None and p["train_count"]:
      self.bar.set_postfix(loss=p["train_loss_sum"] / p["train_count"],
                           samples_s=self._samples_per_second(time.time()))

  def measure_staleness(self) -> None:
    """Per-stage weight discrepancy and gradient cosine (`Schedule.telemetry`) at this
    step: into this step's evaluation row, or a row of their own."""
    self.telemetry = {"step": self.step, **self.schedule.telemetry(self.state)}
    if not self.evaluation_due():
      spe = self.run.steps_per_epoch
      self.writer.write({"epoch": self.step / spe, **self.telemetry})

  def _samples_per_second(self, now: float) -> float:
    seconds = now - self.epoch_start_time - self.paused
    return self.config.batch_size * self.epoch_steps / max(seconds, 1e-9)

  def _end_of_epoch(self) -> bool:
    return self.step % self.run.steps_per_epoch == 0

  def evaluation_due(self) -> bool:
    epoch = self.step // self.run.steps_per_epoch
    every = self.config.get("eval_every_steps", 0)
    return ((self._end_of_epoch() and epoch % self.config.eval_every_epochs == 0)
            or (every > 0 and self.step % every == 0)
            or self.step == self.run.total_steps)

  def evaluate_and_record(self) -> None:
    """Test-set metrics plus the training averages since the last epoch end, to
    metrics.jsonl (and TensorBoard)."""
    self.flush_losses()
    now, p, spe = time.time(), self.progress, self.run.steps_per_epoch
    record = {
        "epoch": self.step // spe if self._end_of_epoch() else self.step / spe,
        "step": self.step,
        "train_loss": _mean(p["train_loss_sum"], p["train_count"]),
        "train_accuracy": _mean(p["train_acc_sum"], p["train_count"]),
        **evaluate(self.schedule, self.state, self.run.test_iter(), self.run.batch_keys),
        "learning_rate": float(self.run.learning_rate(self.step)),
        "samples_per_second": self._samples_per_second(now),
        "wall_time": time.time() - self.run_start,
    }
    if self.telemetry.get("step") == self.step:
      record.update(self.telemetry)
    self.writer.write(record)
    self.final = record
    if self.bar is not None:
      self.bar.set_postfix(loss=record["train_loss"], test_acc=record["test_accuracy"],
                           samples_s=record["samples_per_second"])

  def end_epoch_if_done(self) -> None:
    """At an epoch's end: reset the training averages (where an evaluation happened; one
    where a run stops mid-epoch leaves the sums be) and the epoch's clock and bar."""
    if not self._end_of_epoch():
      return
    if self.evaluation_due():
      self.progress.update(train_loss_sum=0.0, train_acc_sum=0.0, train_count=0)
      self._start_epoch_clock()
    if self.bar is not None:
      self.bar.close()
      self.bar = None

  # ---- checkpoints and stopping --------------------------------------------------------------
  def save(self) -> None:
    """Checkpoints the state at `step`, unless any part of it is non-finite."""
    t0 = time.time()
    self.flush_losses()
    # A parameter can go non-finite ticks before its effect reaches the loss (stage 0's
    # update shows in a loss K ticks later under FDG): never checkpoint such a state.
    bad = _nonfinite_part(self.schedule, self.state)
    if bad is not None:
      self._diverged(f"{bad} non-finite at step {self.step}")
    self.progress["wall_time"] = time.time() - self.run_start
    self.ckpt.save(self.step, self.state, self.run.train_iter.get_state(), self.progress)
    self.last_good = self.step
    self.paused += time.time() - t0

  def stop_if_signalled(self, stop: dict) -> None:
    """After SIGINT/SIGTERM: checkpoint and raise Interrupted.

    Several processes must stop (and join the collective save) at the same step: a signal
    one of them got is acted on at the next log step, agreed by all.
    """
    multi_process = jax.process_count() > 1
    agreed = not multi_process or self.at(self.config.log_every_steps)
    if multi_process and agreed:
      from jax.experimental import multihost_utils
      signums = multihost_utils.process_allgather(np.int32(stop["signum"] or 0))
      stop["signum"] = int(np.max(signums)) or None
    if stop["signum"] is None or not agreed:
      return
    if self.last_good != self.step:
      self.save()
    name = signal.Signals(stop["signum"]).name
    raise Interrupted(f"{name}: stopped at step {self.step}, checkpoint saved in "
                      f"{self.ckpt.directory}; run the same command to resume", stop["signum"])

  # ---- end ---------------------------------------------------------------------------------
  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    self.run.train_iter.close()
    self.writer.close()
    self.ckpt.close()

  def result(self) -> dict:
    """The last evaluation (made now if the loop made none), steps, wall time, params."""
    if not self.final:
      self.final = {"step": self.step, **evaluate(self.schedule, self.state,
                                                  self.run.test_iter(), self.run.batch_keys)}
    wall = time.time() - self.run_start
    if jax.process_index() == 0:
      _log(f"done: {_run_label(self.config)}, {self.step} steps, final test accuracy "
           f"{self.final['test_accuracy']:.4f} (loss {self.final['test_loss']:.4f}) in "
           f"{wall:.1f} s; workdir {self.run.workdir}")
    return {**self.final, "steps": self.step, "wall_time": wall,
            "params": runtime_arrays.fetch(self.schedule.params(self.state))}


def _mean(total, count):
  return total / count if count else None  # null in metrics.jsonl: no batch reached the loss


def _run_label(config) -> str:
  label = f"{config.algorithm.upper()} K={config.num_stages}"
  if config.beta != 1.0:  # only a schedule that takes beta gets past validation with one
    label += f" beta={config.beta:g}"
  return f"{label} {config.model} on {config.dataset}"


def _progress_bar(config, steps_per_epoch, step):
  """A bar over the current epoch (steps, loss, samples/s); None when disabled."""
  if not config.progress_bar:
    return None
  try:
    from tqdm import tqdm
  except ImportError:
    return None
  epoch = step // steps_per_epoch
  return tqdm(total=steps_per_epoch, initial=step % steps_per_epoch, unit="step",
              dynamic_ncols=True, disable=None, leave=True,
              desc=f"epoch {epoch + 1}/{config.num_epochs}")


def _log(msg: str) -> None:
  print(msg, flush=True)


_IDENTITY_FIELDS = ("algorithm", "num_stages", "model", "model_kwargs", "dataset",
                    "batch_size", "seed", "split", "backward", "beta", "num_replicas",
                    "staleness", "dtype", "optimizer", "shrink_at")


_DEFAULTS = {"staleness": "none", "dtype": "float32", "shrink_at": "gradient"}  # identity fields that runs of older versions lack


def _check_or_write_config(config, workdir: str) -> None:
  """Writes config.json, or checks that a resumed run was started with the same method."""
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
    changed = {key: [saved.get(key), current.get(key)]
               for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)}
    if changed and jax.process_index() == 0:
      _log(f"resuming {workdir} with a changed config: " + ", ".join(
          f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()))
      with open(os.path.join(workdir, CONFIG_CHANGES_FILE), "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "changes": changed}) + "\n")
    return  # keep the config the run was started with (config.json)
  if jax.process_index() == 0:
    with open(path, "w") as f:
      json.dump(current, f, indent=2, sort_keys=True)
