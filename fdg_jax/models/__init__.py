"""Models written as sequences of blocks, and a registry of them by name.

    model = fdg_jax.models.create("resnet56", num_classes=10)
    model.blocks          # linen modules, each __call__(x, train: bool)
    model.paper_splits    # {2: (14,), 4: (7, 14, 21)}: the FDG reference code's splits

See `fdg_jax.partition` to split a model into stages.
"""

from __future__ import annotations

import functools
import inspect
import re

from fdg_jax.models.base import BlockRange, Model
from fdg_jax.models.resnet import cifar_resnet, resnet
from fdg_jax.models.simple import cnn, mlp
from fdg_jax.models.wrn import wrn

_BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    **{f"resnet{d}": functools.partial(cifar_resnet, d) for d in (20, 32, 44, 56, 110, 1202)},
    **{f"resnet{d}": functools.partial(resnet, d) for d in (18, 34, 50, 101)},
    "wrn28_10": functools.partial(wrn, 28, 10),
    "wrn": wrn,  # general WRN: create("wrn", depth=16, width=4)
}

# "wrn16_4" etc. are accepted too, as create("wrn", depth=16, width=4).
_WRN_NAME = re.compile(r"wrn(\d+)_(\d+)")


def names() -> list[str]:
  """The registered model names (any "wrn<depth>_<width>" is accepted as well)."""
  return sorted(_BUILDERS)


def create(name: str, num_classes: int = 10, **kwargs) -> Model:
  """Builds a registered model.

  Args:
    name: one of `names()`, or "wrn<depth>_<width>".
    num_classes: output width of the head.
    **kwargs: model options, e.g. shortcut="B" (CIFAR ResNets), stem="imagenet" (ResNet-18..101),
      dropout=0.3 (WRN), widths=(64, 32) (mlp), bn_axis_name="data" (synchronised BatchNorm).

  Raises:
    ValueError: unknown name, or an option the model does not take.
  """
  builder = _BUILDERS.get(name)
  if builder is None and (m := _WRN_NAME.fullmatch(name)):
    builder = functools.partial(wrn, int(m.group(1)), int(m.group(2)), name=name)
  if builder is None:
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(names())} "
                     "(and wrn<depth>_<width>)")
  try:
    inspect.signature(builder).bind(num_classes=num_classes, **kwargs)
  except TypeError as e:
    options = [p for p in inspect.signature(builder).parameters if p != "num_classes"]
    raise ValueError(f"model {name!r}: {e}; its options are: {', '.join(options)}") from None
  return builder(num_classes=num_classes, **kwargs)


__all__ = ["BlockRange", "Model", "cifar_resnet", "cnn", "create", "mlp", "names", "resnet",
           "wrn"]
