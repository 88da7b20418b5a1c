"""The papers' CIFAR experiments, selected by argument.

    python train.py --config configs/cifar10.py:model=resnet56,k=4,algorithm=fdg,beta=0.5
    python train.py --config configs/cifar10.py:model=wrn28_10,k=2,algorithm=ddg

Arguments (comma-separated key=value, all optional):
  model      resnet20 | resnet56 | resnet110 | resnet18 | wrn28_10   (default resnet56)
  k          number of stages, 1..4                                   (default 2)
  algorithm  bp | ddg | fdg                                           (default fdg)
  beta       FDG gradient shrinking; default: the best beta the FDG paper reports for this
             model and K (1.0 where it reports none)
  split      paper | balanced | uniform  (default: paper where the FDG code has one, else
             balanced)
  runlocal   1: a tiny run (2 epochs, batch 32, 20 steps) to smoke-test the set-up

Settings from the papers: FDG uses SGD lr 0.1, momentum 0.9, weight decay 5e-4, batch 128,
300 epochs, lr /10 at epochs 150, 225, 275; DDG uses lr 0.01 with Nesterov momentum and
lr /10 at 150 and 225. Standard augmentation (pad 4 + random crop + flip).
"""

import importlib.util
import pathlib

import ml_collections


def _sibling(name: str):
  """Loads configs/<name>.py by path, so this file works from any working directory."""
  path = pathlib.Path(__file__).with_name(f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"_fdg_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


default = _sibling("default")

DATASET = "cifar10"
MODELS = ("resnet20", "resnet56", "resnet110", "resnet18", "wrn28_10")
# The best beta the FDG paper reports, by (dataset, model, K).
BEST_BETA = {
    ("cifar10", "resnet20", 2): 0.2, ("cifar10", "resnet56", 2): 0.5,
    ("cifar10", "resnet110", 2): 0.5, ("cifar10", "resnet18", 2): 0.8,
    ("cifar10", "wrn28_10", 2): 0.7, ("cifar10", "resnet56", 3): 0.5,
    ("cifar10", "resnet56", 4): 0.5,
    ("cifar100", "resnet56", 2): 0.4, ("cifar100", "resnet110", 2): 0.5,
    ("cifar100", "resnet18", 2): 0.5,
}


def parse_args(arg: str | None) -> dict:
  """'a=1,b=x' -> {'a': '1', 'b': 'x'}; unknown keys are rejected."""
  known = {"model", "k", "algorithm", "beta", "split", "runlocal"}
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, sep, value = item.partition("=")
    if not sep or key not in known:
      raise ValueError(f"bad config argument {item!r}; expected key=value with key in "
                       f"{sorted(known)}")
    out[key] = value
  return out


def make(dataset: str, arg: str | None) -> ml_collections.ConfigDict:
  args = parse_args(arg)
  c = default.get_config()
  model = args.get("model", "resnet56")
  if model not in MODELS:
    raise ValueError(f"model={model!r}; the papers' CIFAR models are {', '.join(MODELS)}")
  k = int(args.get("k", 2))
  algorithm = args.get("algorithm", "fdg")
  c.model = model
  c.model_kwargs = ml_collections.ConfigDict()
  c.dataset = dataset
  c.num_stages = k
  c.algorithm = algorithm
  c.beta = float(args.get("beta", BEST_BETA.get((dataset, model, k), 1.0)
                          if algorithm == "fdg" else 1.0))
  # The FDG reference code's hand split where it has one (the model knows its paper splits).
  from fdg_jax import models
  has_paper = k in models.create(model).paper_splits
  c.split = args.get("split", "paper" if has_paper else "balanced")
  c.batch_size = 128
  c.num_epochs = 300
  c.optimizer = "sgd"
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.lr_schedule = "multistep"
  c.warmup_epochs = 0.0
  if algorithm == "ddg":
    c.learning_rate, c.nesterov, c.lr_milestones = 0.01, True, (150, 225)
  else:
    c.learning_rate, c.nesterov, c.lr_milestones = 0.1, False, (150, 225, 275)
  c.checkpoint_every_steps = 2000
  c.eval_every_epochs = 1
  c.eval_batch_size = 500
  c.num_cpu_devices = k
  if args.get("runlocal") == "1":
    c.batch_size, c.num_epochs, c.max_steps, c.eval_batch_size = 32, 2, 20, 100
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return make(DATASET, arg)
