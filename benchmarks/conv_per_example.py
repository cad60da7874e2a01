"""Per-example weight gradients of a Conv2d: the library's grouped ``convolution_backward``
against the other ways to form them, and against the batch-summed gradient a bare step forms.

    python benchmarks/conv_per_example.py --batch 64 --repeats 15

The layer is the paper CNN's second convolution (32 → 32 channels, 3×3, a 26×26 input:
``experiments.cnn.PaperCNN.conv2``), the one that dominates a private step's per-example
work. Every alternative is checked against the library's result
(:func:`flwr_corrnoise.torch.grad_sample.conv2d_grad_sample`) before any is timed; then
``--repeats`` rotations over all of them (one thread), the median ms of each. Prints a
markdown table: ms and × the batch-summed gradient.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from flwr_corrnoise.torch.grad_sample import _conv2d_weight_per_example, conv2d_grad_sample


def alternatives(m: torch.nn.Conv2d, a: torch.Tensor, d: torch.Tensor
                 ) -> dict[str, Callable[[], torch.Tensor]]:
    """name → a function returning the ``(b, *weight.shape)`` per-example gradients (the
    batch-summed row returns the sum)."""
    b, out_ch, h, w = d.shape
    kh, kw = m.kernel_size
    conv_bwd = torch.ops.aten.convolution_backward
    weight = m.weight.detach()  # no autograd record in any row (the library's detaches)

    def library() -> torch.Tensor:  # the layer's grad sampler (its weight and bias)
        piece = conv2d_grad_sample(m, a, d)["weight"]
        assert isinstance(piece, torch.Tensor)
        return piece

    def chunks() -> torch.Tensor:  # the sampler's grouped call on 8 examples at a time
        return torch.cat([_conv2d_weight_per_example(m, a[i:i + 8], d[i:i + 8])
                          for i in range(0, b, 8)])

    def no_onednn() -> torch.Tensor:
        with torch.backends.mkldnn.flags(enabled=False):
            return _conv2d_weight_per_example(m, a, d)

    def loop() -> torch.Tensor:
        return torch.stack([conv_bwd(d[i:i + 1], a[i:i + 1], weight, None, m.stride,
                                     m.padding, m.dilation, False, (0, 0), 1,
                                     (False, True, False))[1] for i in range(b)])

    def channels_last() -> torch.Tensor:
        cl = torch.channels_last
        return conv_bwd(d.reshape(1, b * out_ch, h, w).contiguous(memory_format=cl),
                        a.reshape(1, b * m.in_channels, *a.shape[2:]).contiguous(
                            memory_format=cl),
                        weight.repeat(b, 1, 1, 1), None, m.stride, m.padding,
                        m.dilation, False, (0, 0), b,
                        (False, True, False))[1].view(b, *m.weight.shape)

    def shifted_bmm() -> torch.Tensor:
        out = torch.empty(b, *m.weight.shape)
        flat = d.reshape(b, out_ch, h * w)
        for dy in range(kh):
            for dx in range(kw):
                shifted = a[:, :, dy:dy + h, dx:dx + w].reshape(b, m.in_channels, h * w)
                out[:, :, :, dy, dx] = torch.bmm(flat, shifted.transpose(1, 2))
        return out

    def correlation() -> torch.Tensor:
        y = torch.nn.functional.conv2d(a.transpose(0, 1), d.reshape(b * out_ch, 1, h, w),
                                       groups=b)
        return y.view(m.in_channels, b, out_ch, kh, kw).permute(1, 2, 0, 3, 4)

    def batch_summed() -> torch.Tensor:
        return conv_bwd(d, a, weight, None, m.stride, m.padding, m.dilation, False,
                        (0, 0), 1, (False, True, False))[1]

    return {"the library's: one grouped convolution_backward (b groups)": library,
            "calls of 8 groups": chunks, "the same, oneDNN off": no_onednn,
            "a loop over the examples": loop, "channels-last": channels_last,
            "nine shifted bmm (one per kernel offset)": shifted_bmm,
            "a grouped conv2d correlation": correlation,
            "batch-summed (a bare step's weight gradient)": batch_summed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = torch.nn.Conv2d(32, 32, 3)
    a = torch.randn(args.batch, 32, 26, 26)
    d = torch.randn(args.batch, 32, 24, 24)
    fns = alternatives(m, a, d)
    ref = fns["the library's: one grouped convolution_backward (b groups)"]()
    for name, fn in fns.items():  # checked, and each run once before any is timed
        got = fn()
        want = ref.sum(0) if name.startswith("batch-summed") else ref
        if got.shape != want.shape or (got - want).norm() > 1e-5 * want.norm():
            raise SystemExit(f"{name}: not the library's per-example gradients")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):  # in rotation: each sees the same machine state
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    times = {name: statistics.median(ts) for name, ts in samples.items()}
    base = times["batch-summed (a bare step's weight gradient)"]
    print(f"Conv2d 32 → 32, 3×3, 26×26 input, batch {args.batch}, 1 thread, torch "
          f"{torch.__version__}; median of {args.repeats}")
    print("| per-example weight gradients | ms | × batch-summed |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {1e3 * t:.2f} | {t / base:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
