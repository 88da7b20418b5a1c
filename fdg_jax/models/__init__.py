"""Models written as sequences of blocks, and a registry of them by name.

    model = fdg_jax.models.create("resnet56", num_classes=10)
    model.blocks          # linen modules, each __call__(x, train: bool)
    model.paper_splits    # {2: (14,), 4: (7, 14, 21)}: the FDG reference code's splits

Transformers (`fdg_jax.models.transformer`): "vit" (images) and "gpt" (int tokens [B, T] ->
logits [B, T, vocab]; its num_classes is the vocabulary size, default 256), with the presets
"vit_tiny" and "gpt_tiny".

See `fdg_jax.partition` to split a model into stages.
"""

from __future__ import annotations

import functools
import inspect
import re

from fdg_jax.models.base import BlockRange, Model
from fdg_jax.models.resnet import cifar_resnet, resnet
from fdg_jax.models.simple import cnn, mlp
from fdg_jax.models.transformer import gpt, lm_loss, vit
from fdg_jax.models.wrn import wrn

_BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    **{f"resnet{d}": functools.partial(cifar_resnet, d) for d in (20, 32, 44, 56, 110, 1202)},
    **{f"resnet{d}": functools.partial(resnet, d) for d in (18, 34, 50, 101)},
    "wrn28_10": functools.partial(wrn, 28, 10),
    "wrn": wrn,  # general WRN: create("wrn", depth=16, width=4)
    "vit": vit,  # create("vit", input_shape=(8, 8, 1), patch_size=2, depth=4, ...)
    # ViT-Ti sizes (DeiT-Ti) on 4x4 patches of CIFAR images.
    "vit_tiny": functools.partial(vit, patch_size=4, dim=192, depth=12, num_heads=3,
                                  name="vit_tiny"),
    "gpt": gpt,  # create("gpt", num_classes=256, seq_len=128, depth=4, ...)
    # A small byte-level LM (vocabulary 256) for the offline text corpus, `fdg_jax.data.text`.
    "gpt_tiny": functools.partial(gpt, seq_len=128, dim=128, depth=4, num_heads=4,
                                  name="gpt_tiny"),
}

# "wrn16_4" etc. are accepted too, as create("wrn", depth=16, width=4).
_WRN_NAME = re.compile(r"wrn(\d+)_(\d+)")


def names() -> list[str]:
  """The registered model names (any "wrn<depth>_<width>" is accepted as well)."""
  return sorted(_BUILDERS)


def create(name: str, num_classes: int | None = None, **kwargs) -> Model:
  """Builds a registered model.

  Args:
    name: one of `names()`, or "wrn<depth>_<width>".
    num_classes: output width of the head; for "gpt" models the vocabulary size. None: the
      model's default (10; 256 for the byte-level "gpt" models).
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
  if num_classes is not None:
    kwargs["num_classes"] = num_classes
  try:
    inspect.signature(builder).bind(**kwargs)
  except TypeError as e:
    options = [p for p in inspect.signature(builder).parameters if p != "num_classes"]
    raise ValueError(f"model {name!r}: {e}; its options are: {', '.join(options)}") from None
  return builder(**kwargs)


__all__ = ["BlockRange", "Model", "cifar_resnet", "cnn", "create", "gpt", "lm_loss", "mlp",
           "names", "resnet", "vit", "wrn"]
