"""Backward convolutions at the top level of a program vs nested in a loop or a switch.

    python -m fdg_jax.bench nested [--batch 64] [--size 32] [--channels 16] [--repeats 7]

XLA:CPU runs a convolution's weight gradient inside a nested computation (a `lax.scan`
body, a `lax.switch` branch) 10-40x slower than at the top level of a program, which is why
the fused engine calls a one-tick program T times for convolutional models on CPU instead
of scanning. This prints, per platform, ms per call of:

  top        one weight gradient (3x3 convolution, NHWC) at the top level;
  switch     the same inside `lax.switch` (the index is a traced argument);
  loop4      four of them in a Python loop inside one program (unrolled);
  scan4      four of them in `lax.scan`;
  input      one input gradient at the top level, and `input_scan4` four in `lax.scan`.

and the ratios switch/top, scan4/loop4 and input_scan4/(4 input). Run it on a GPU or TPU
to see whether `Schedule.scan`'s CPU rule should apply there too.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m fdg_jax.bench nested",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--size", type=int, default=32, help="height = width of the activations")
  p.add_argument("--channels", type=int, default=16)
  p.add_argument("--repeats", type=int, default=7, help="timed calls; the median is printed")
  p.add_argument("--out", default=None, help="also write the figures to this JSON file")
  return p.parse_args(argv)


def _median_ms(fn, args, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[len(times) // 2]


def programs(batch: int, size: int, channels: int):
  """The jitted programs and their arguments, by row name."""
  import jax
  import jax.numpy as jnp
  from jax import lax

  dims = ("NHWC", "HWIO", "NHWC")
  conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (batch, size, size, channels))
  w = jax.random.normal(keys[1], (3, 3, channels, channels)) * 0.1
  g = jax.random.normal(keys[2], (batch, size, size, channels))

  def weight_grad(x, w, g):
    return jax.vjp(lambda w: conv(x, w), w)[1](g)[0]

  def input_grad(x, w, g):
    return jax.vjp(lambda x: conv(x, w), x)[1](g)[0]

  def switch(i, x, w, g):
    return lax.switch(i, [lambda: weight_grad(x, w, g), lambda: jnp.zeros_like(w)])

  # Four distinct gradients: a weight gradient depends on the input only (an input gradient
  # on the weights only), so each of the four gets its own shifted input (weights).
  shifted = lambda grad, k, x, w, g: (grad(x + k, w, g) if grad is weight_grad
                                      else grad(x, w + k, g))

  def loop4(x, w, g):
    return sum(shifted(weight_grad, k, x, w, g) for k in range(4))

  def scan4(grad):
    def run(x, w, g):
      def body(acc, k):
        return acc + shifted(grad, k, x, w, g), None
      return lax.scan(body, jnp.zeros_like(grad(x, w, g)), jnp.arange(4.0))[0]
    return run

  return {
      "top": (jax.jit(weight_grad), (x, w, g)),
      "switch": (jax.jit(switch), (jnp.int32(0), x, w, g)),
      "loop4": (jax.jit(loop4), (x, w, g)),
      "scan4": (jax.jit(scan4(weight_grad)), (x, w, g)),
      "input": (jax.jit(input_grad), (x, w, g)),
      "input_scan4": (jax.jit(scan4(input_grad)), (x, w, g)),
  }


def main(argv=None) -> dict:
  import jax
  args = parse_args(argv)
  ms = {name: _median_ms(fn, fn_args, args.repeats)
        for name, (fn, fn_args) in programs(args.batch, args.size, args.channels).items()}
  ratios = {"switch/top": ms["switch"] / ms["top"], "scan4/loop4": ms["scan4"] / ms["loop4"],
            "input_scan4/(4 input)": ms["input_scan4"] / (4 * ms["input"])}
  device = jax.devices()[0]
  print(f"{device.platform} ({device.device_kind}), batch {args.batch}, "
        f"{args.size}x{args.size}x{args.channels}, 3x3 convolution, median of {args.repeats}")
  for name, value in ms.items():
    print(f"{name:<22} {value:9.3f} ms")
  for name, value in ratios.items():
    print(f"{name:<22} {value:9.2f}x")
  figures = {"platform": device.platform, "device_kind": device.device_kind, "ms": ms,
             "ratios": ratios, "args": vars(args)}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(figures, f, indent=1)
  return figures
