"""What the schedule benchmarks share: the schedules they run (read from the registry,
`fdg_jax.plans`), their models, stages, batches, optimiser and loss, where the stages are
placed, and the machine's description.

Every benchmark module (throughput, overhead, dispatch, memory, speedup) imports this one;
it imports none of them.
"""

from __future__ import annotations

import json
import os
import platform
import sys

from fdg_jax import plans as plans_lib

# The baseline of every ratio and speed-up the benchmarks report: backpropagation, unsplit
# (K=1). A choice of schedule, as a user makes one, not a list of them: the one name the
# benchmarks spell out.
REFERENCE = "bp"

# As registered when this module was imported (for code that reads them as constants); the
# benchmarks themselves ask the registry when they run, so that a schedule registered later
# is benchmarked too.
ALGORITHMS = plans_lib.names(microbatched=False)  # the tick plans: the default of --algorithms
SYNC = plans_lib.names(microbatched=True)  # the synchronous pipelines
PLANS = ALGORITHMS + SYNC  # every schedule `throughput` can run
POLICIES = ("stash", "recompute")

# Memory presets: (model, model kwargs, input shape or None for the model's, batch size).
PRESETS = {
    "resnet20": ("resnet20", {}, None, 128),       # CIFAR-sized input
    "resnet56": ("resnet56", {}, None, 128),
    "mlp_digits": ("mlp", {"widths": (128, 128, 128, 128)}, (8, 8, 1), 32),  # the quick start
    "mlp_bench": ("mlp", {"widths": (1024, 1024, 1024, 1024)}, (1024,), 128),  # the default
    "vit": ("vit", {}, None, 32),                   # CIFAR-sized ViT (LayerNorm)
}
# The default benchmark model: four equal 1024-wide dense blocks (and a small head) on
# 1024-dim inputs, so that a balanced split into 2 or 4 stages is exact and the speed-up
# model is not limited by one heavy block. Small enough for CPU; use --model on GPUs.
DEFAULT_MODEL_KWARGS = {"mlp": {"widths": [1024, 1024, 1024, 1024]}}
DEFAULT_INPUT_SHAPE = {"mlp": [1024]}
TINY = ("mlp", {"widths": (16, 16, 16, 16)}, (8, 8, 1), 8)  # the dispatch benchmark's model

# --dtype: the stages compute in it (float32 master weights; `fdg_jax.precision`).
COMPUTE_DTYPE = "float32"


def _jax():
  import jax
  return jax


# ------------------------------------------------------------------------------ schedules
def tick_plans() -> tuple:
  """The registered schedules that run one batch per tick (the default of --algorithms)."""
  return plans_lib.names(microbatched=False)


def every_plan() -> tuple:
  """Every registered schedule: the tick plans, then the synchronous pipelines."""
  return plans_lib.names(microbatched=False) + plans_lib.names(microbatched=True)


def with_backward(algorithms) -> list[str]:
  """Those of `algorithms` whose backward policy matters: the delayed tick plans (BP's one
  slot is read within its tick)."""
  return [a for a in algorithms if plans_lib.spec(a).delayed
          and not plans_lib.spec(a).microbatched and "backward" in plans_lib.spec(a).options]


def make_schedule(algorithm, stages, *, backward="stash", devices=None, engine="auto",
                  compiler_options=None, mesh=None, gate=None, microbatches: int = 4):
  import fdg_jax
  if plans_lib.spec(algorithm).microbatched:
    return fdg_jax.create(algorithm, stages, loss_fn, optimizer(), devices=devices,
                          engine=engine, microbatches=microbatches)
  kwargs = {"devices": devices, "engine": engine, "compiler_options": compiler_options,
            "mesh": mesh, "gate": gate}
  if "backward" in plans_lib.spec(algorithm).options:
    kwargs["backward"] = backward
  return fdg_jax.create(algorithm, stages, loss_fn, optimizer(), **kwargs)


def call_paths(args) -> list[tuple[str, int | None]]:
  """(label, T) of the calls timed: `step` (T None) and/or `run` of T ticks per call."""
  return [("step", None) if p == "step" else (f"run T={args.run_ticks}", args.run_ticks)
          for p in args.paths]


# ------------------------------------------------------------------------------ models
def build_model(model_name: str, model_kwargs: dict, input_shape=None):
  """The registered model, with `input_shape` passed to models that take one (mlp, cnn).

  A model that takes none (the ResNets: convolutions and a global pooling, so any image size
  works) gets `input_shape` as its example shape instead, e.g. ResNet-110 at 8x8: the same
  programs and leaves as at 32x32, with a sixteenth of the compute, for dispatch timings on
  CPU devices that share the host's cores.
  """
  import dataclasses
  from fdg_jax import models
  kwargs = dict(model_kwargs or {})
  if input_shape is None:
    return models.create(model_name, num_classes=10, **kwargs)
  shape = tuple(int(s) for s in input_shape)
  try:
    return models.create(model_name, num_classes=10, input_shape=shape, **kwargs)
  except ValueError as e:
    if "input_shape" not in str(e):
      raise
  model = models.create(model_name, num_classes=10, **kwargs)
  if len(shape) != len(model.input_shape) or shape[-1] != model.input_shape[-1]:
    raise ValueError(f"--input_shape {shape} for {model_name}: give (H, W, "
                     f"{model.input_shape[-1]}), like its own {model.input_shape}")
  return dataclasses.replace(model, input_shape=shape)


def build_stages(model, num_stages: int, split, batch_size: int):
  """Stages, params and model states of `model` split into `num_stages` (`split` as in
  `partition.boundaries`)."""
  import jax.numpy as jnp
  import fdg_jax
  from fdg_jax import partition
  x = model.example_input(batch_size)
  bounds = partition.boundaries(model, num_stages, split, example_input=x) \
      if num_stages > 1 else []
  stages = partition.stages_from_boundaries(model, bounds)
  x1 = jnp.zeros((1,) + tuple(model.input_shape), jnp.float32)
  params, states = fdg_jax.init_stages(stages, _jax().random.PRNGKey(0), x1)
  from fdg_jax import precision
  stages = [precision.mixed_precision(s, precision.DTYPES[COMPUTE_DTYPE]) for s in stages]
  return bounds, stages, params, states


def loss_fn(logits, labels):
  """The trainer's loss, in float32 (imported lazily: this module keeps its CLI start-up
  light)."""
  from fdg_jax.trainer import loss_fn as trainer_loss
  return trainer_loss(logits.astype("float32"), labels)


def optimizer():
  """SGD with momentum: the papers' optimiser (its update cost is part of a tick)."""
  import optax
  return optax.sgd(0.01, momentum=0.9)


def random_batch(model, batch_size: int, device=None):
  jax = _jax()
  kx, ky = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (batch_size,) + tuple(model.input_shape), jax.numpy.float32)
  y = jax.random.randint(ky, (batch_size,), 0, model.num_classes, jax.numpy.int32)
  if device is not None:
    x, y = jax.device_put((x, y), device)
  return x, y


def jax_leaves(tree) -> list:
  return _jax().tree.leaves(tree)


def tree_bytes(tree) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in _jax().tree.leaves(tree)))


# ------------------------------------------------------------------------------ placement
def placement_for(num_stages: int):
  """(devices argument, label): K distinct devices when there are K, else one."""
  devs = _jax().devices()
  if num_stages > 1 and len(devs) >= num_stages:
    return devs[:num_stages], f"{num_stages} devices"
  return None, "1 device"


def mesh_for(num_replicas: int, num_stages: int):
  """An R x K (data, stage) mesh of this process's devices, or None where there are too
  few."""
  from fdg_jax.placement import make_mesh
  if len(_jax().devices()) < num_replicas * num_stages or num_stages < 2:
    return None
  return make_mesh(num_replicas, num_stages)


def first_place(where: dict):
  """Where stage 0's batch lives: its device, its column of the mesh (split along the
  batch), or the default device."""
  if where.get("devices"):
    return where["devices"][0]
  if where.get("mesh") is not None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    column = Mesh(where["mesh"].devices[:, 0], ("data",))
    return NamedSharding(column, PartitionSpec("data"))
  return None


# ------------------------------------------------------------------------------ reporting
def device_info() -> dict:
  jax = _jax()
  devs = jax.devices()
  return {"platform": devs[0].platform, "device_kind": devs[0].device_kind,
          "num_devices": len(devs), "devices": [str(d) for d in devs],
          "jax": jax.__version__, "host": platform.node(), "cpu_count": os.cpu_count(),
          # Other processes' load: timings on a shared machine are only as good as this.
          "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
          # XLA:CPU sizes its runtime's thread pools from NPROC when set (else the cores).
          "NPROC": os.environ.get("NPROC")}


def write_figures(figures: dict, path: str | None) -> dict:
  """`figures` as indented JSON to `path` (if one is given); returns them."""
  if path:
    with open(path, "w") as f:
      json.dump(figures, f, indent=1)
  return figures


def progress(msg: str) -> None:
  """One line of progress on stderr (the tables go to stdout)."""
  print(f"  {msg}", file=sys.stderr, flush=True)
