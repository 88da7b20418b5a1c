"""Small layer helpers shared by the model files (PyTorch-equivalent padding and BN constants)."""

from __future__ import annotations

import functools

import flax.linen as nn

# He (fan-out) normal init for convolutions, as torchvision and the CIFAR ResNet codes use.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def conv(features: int, kernel: int, strides: int = 1, name=None) -> nn.Conv:
  """A bias-free conv with PyTorch's symmetric padding (k // 2 on each side).

  XLA's "SAME" pads (0, 1) for stride 2 on even inputs where PyTorch pads (1, 1); the explicit
  padding keeps the function the one the reference code computes.
  """
  p = kernel // 2
  return nn.Conv(features, (kernel, kernel), strides=(strides, strides), padding=((p, p), (p, p)),
                 use_bias=False, kernel_init=conv_init, name=name)


def batch_norm(train: bool, axis_name: str | None = None, name=None) -> nn.BatchNorm:
  """BatchNorm with PyTorch's defaults (running-average momentum 0.1, eps 1e-5).

  `axis_name` synchronises batch statistics across a mapped axis (data-parallel replicas).
  """
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                      axis_name=axis_name, name=name)


def global_avg_pool(x):
  """Mean over the spatial axes of an NHWC tensor."""
  return x.mean(axis=(1, 2))


max_pool_3x3_s2 = functools.partial(nn.max_pool, window_shape=(3, 3), strides=(2, 2),
                                    padding=((1, 1), (1, 1)))
