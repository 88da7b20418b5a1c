"""Batch image transforms in numpy: normalisation, pad+crop+flip, ImageNet crops.

Randomness is split in two: ``sample_*`` functions draw the parameters of a whole batch
from a ``np.random.Generator`` (vectorised), and the ``apply``-style functions are
deterministic given those parameters. ``BatchIterator`` draws the parameters of the
*global* batch and slices its own rows, so a process shard is exactly the matching rows of
the unsharded batch.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fdg_jax.data.registry import DatasetSpec

IMAGENET_SIZE = 224
IMAGENET_RESIZE = 256
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3.0 / 4.0, 4.0 / 3.0)
RRC_ATTEMPTS = 10


def normalize(images: np.ndarray, spec: DatasetSpec, out: np.ndarray | None = None
              ) -> np.ndarray:
  """``(images / spec.pixel_max - mean) / std`` per channel, computed in float32.

  Args:
    images: uint8 (or any real) ``[..., C]``.
    spec: gives ``pixel_max``, ``mean`` and ``std`` (length C).
    out: optional float32 array of the same shape to write into (e.g. shared memory);
      the values are the same as without it.

  Returns:
    ``out``, else a new C-contiguous float32 array of the same shape: float32 ``x * scale
    - offset`` per channel (two float32 roundings, exactly the values of the earlier
    256-entry lookup table). The per-channel factors are tiled along whole image rows so
    numpy's inner loops run over ``W * C`` values, not ``C``: ~0.3 ms per 224 x 224 x 3
    image, 3.5x faster than the lookup table.
  """
  mean = np.asarray(spec.mean, np.float64)
  std = np.asarray(spec.std, np.float64)
  scale = (1.0 / (spec.pixel_max * std)).astype(np.float32)
  offset = (mean / std).astype(np.float32)
  images = np.asarray(images)
  if images.dtype == np.uint8:
    if out is None:
      out = np.empty(images.shape, np.float32)
    dest = out if out.flags.c_contiguous else np.empty(images.shape, np.float32)
    reps = images.shape[-2] if images.ndim >= 2 else 1
    row = reps * images.shape[-1]
    flat_in = np.ascontiguousarray(images).reshape(-1, row)
    flat_out = dest.reshape(-1, row)  # a view: dest is C-contiguous
    np.multiply(flat_in, np.tile(scale, reps), out=flat_out, dtype=np.float32)
    np.subtract(flat_out, np.tile(offset, reps), out=flat_out)
    if dest is not out:
      out[...] = dest
    return out
  result = images.astype(np.float32, order="C")
  result *= scale
  result -= offset
  if out is None:
    return result
  out[...] = result
  return out


def sample_crop_flip(rng: np.random.Generator, n: int, pad: int, flip: bool
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Draws pad+crop(+flip) parameters for ``n`` images.

  Returns ``(dy [n], dx [n], do_flip [n] bool)`` with offsets uniform in ``[0, 2*pad]``
  into the padded image and flips with probability 1/2 (always False if not ``flip``).
  """
  dy = rng.integers(0, 2 * pad + 1, size=n)
  dx = rng.integers(0, 2 * pad + 1, size=n)
  do_flip = rng.random(n) < 0.5
  if not flip:
    do_flip[:] = False
  return dy, dx, do_flip


def crop_flip(images: np.ndarray, dy: np.ndarray, dx: np.ndarray, do_flip: np.ndarray,
              pad: int) -> np.ndarray:
  """Zero-pads a batch by ``pad`` pixels, crops it back to its size at per-image offsets
  and mirrors the flagged images horizontally. Fully vectorised (no per-image loop).

  Args:
    images: ``[B, H, W, C]`` (any dtype; padding value 0, i.e. black for raw pixels).
    dy, dx: int ``[B]`` offsets in ``[0, 2*pad]`` (``pad, pad`` is the identity crop).
    do_flip: bool ``[B]``.
    pad: padding in pixels.

  Returns:
    C-contiguous ``[B, H, W, C]`` array, same dtype.
  """
  b, h, w, c = images.shape
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  # One C-byte item per pixel, so a window copy moves whole pixels with no transpose.
  pixels = np.ascontiguousarray(padded).view(np.dtype((np.void, c * images.itemsize)))
  # [B, 2p+1, 2p+1, H, W] view of every crop; pick one window per image (a copy).
  windows = sliding_window_view(pixels[..., 0], (h, w), axis=(1, 2))
  out = windows[np.arange(b), dy, dx]
  if do_flip.any():
    out[do_flip] = out[do_flip][:, :, ::-1]
  return out[..., None].view(images.dtype).reshape(b, h, w, c)


def sample_rrc_uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
  """Draws the uniforms behind ImageNet random-resized crops + flips of ``n`` images:
  float64 ``[n, RRC_ATTEMPTS, 4]`` (area, log-ratio, y, x) and ``[n]`` flip uniforms,
  packed as ``[n, RRC_ATTEMPTS * 4 + 1]``. The boxes follow once image sizes are known."""
  return rng.random((n, RRC_ATTEMPTS * 4 + 1))


def rrc_boxes(heights: np.ndarray, widths: np.ndarray, uniforms: np.ndarray,
              scale: Sequence[float] = RRC_SCALE, ratio: Sequence[float] = RRC_RATIO
              ) -> np.ndarray:
  """Random-resized-crop boxes (Inception/torchvision rule), vectorised over images.

  For each image, up to ``RRC_ATTEMPTS`` candidates of area ``U(scale) * h * w`` and aspect
  ratio ``exp(U(log ratio))``; the first that fits is placed uniformly at random; if none
  fits, a center crop with the aspect ratio clamped to ``ratio``.

  Args:
    heights, widths: int ``[n]`` image sizes.
    uniforms: ``[n, RRC_ATTEMPTS * 4 + 1]`` from ``sample_rrc_uniforms``.

  Returns:
    int64 ``[n, 4]`` boxes ``(top, left, crop_h, crop_w)``.
  """
  h = np.asarray(heights, np.float64)[:, None]
  w = np.asarray(widths, np.float64)[:, None]
  u = uniforms[:, :RRC_ATTEMPTS * 4].reshape(-1, RRC_ATTEMPTS, 4)
  area = h * w * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
  log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[..., 1]
  aspect = np.exp(log_r)
  cw = np.round(np.sqrt(area * aspect))
  ch = np.round(np.sqrt(area / aspect))
  ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
  first = np.argmax(ok, axis=1)
  rows = np.arange(u.shape[0])
  any_ok = ok[rows, first]
  ch, cw = ch[rows, first], cw[rows, first]
  top = np.floor(u[rows, first, 2] * (h[:, 0] - ch + 1))
  left = np.floor(u[rows, first, 3] * (w[:, 0] - cw + 1))
  # Fallback: center crop of the whole image, aspect ratio clamped.
  h0, w0 = h[:, 0], w[:, 0]
  in_ratio = w0 / h0
  fw = np.where(in_ratio < ratio[0], w0, np.where(in_ratio > ratio[1], np.round(h0 * ratio[1]), w0))
  fh = np.where(in_ratio < ratio[0], np.round(w0 / ratio[0]), h0)
  ftop = np.floor((h0 - fh) / 2)
  fleft = np.floor((w0 - fw) / 2)
  boxes = np.stack([np.where(any_ok, top, ftop), np.where(any_ok, left, fleft),
                    np.where(any_ok, ch, fh), np.where(any_ok, cw, fw)], axis=1)
  return boxes.astype(np.int64)


def resize_box(image: np.ndarray, box: Sequence[float], size: int) -> np.ndarray:
  """Crops ``box = (top, left, crop_h, crop_w)`` (floats allowed) of one uint8 ``[h, w, C]``
  image and resizes it to ``[size, size, C]`` (bilinear, antialiased, PIL)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  top, left, ch, cw = (float(v) for v in box)
  squeeze = image.shape[-1] == 1
  pil = Image.fromarray(image[..., 0] if squeeze else image)
  out = np.asarray(pil.resize((size, size), Image.BILINEAR,
                              box=(left, top, left + cw, top + ch)))
  return out[..., None] if squeeze else out


def center_box(h: int, w: int, size: int = IMAGENET_SIZE, resize: int = IMAGENET_RESIZE
               ) -> tuple[float, float, float, float]:
  """The box of an ``h x w`` image that "resize shorter side to ``resize``, center crop
  ``size``" keeps, in original pixel coordinates: ``(top, left, side, side)``."""
  side = min(h, w) * size / resize
  return ((h - side) / 2, (w - side) / 2, side, side)


def imagenet_batch(images: Sequence[np.ndarray], uniforms: np.ndarray | None,
                   size: int = IMAGENET_SIZE) -> np.ndarray:
  """ImageNet crops of a list of variable-size uint8 ``[h_i, w_i, 3]`` images.

  With ``uniforms`` (``sample_rrc_uniforms``): random-resized crop + horizontal flip with
  probability 1/2 (training). With None: resize 256 / center crop 224 (evaluation).
  Returns uint8 ``[n, size, size, C]``.
  """
  n = len(images)
  if n == 0:
    return np.zeros((0, size, size, 3), np.uint8)
  if uniforms is None:
    boxes = [center_box(im.shape[0], im.shape[1], size) for im in images]
  else:
    boxes = rrc_boxes(np.array([im.shape[0] for im in images]),
                      np.array([im.shape[1] for im in images]), uniforms)
  out = np.stack([resize_box(im, box, size) for im, box in zip(images, boxes)])
  if uniforms is not None:
    flip = uniforms[:, -1] < 0.5
    out[flip] = out[flip][:, :, ::-1]
  return out
