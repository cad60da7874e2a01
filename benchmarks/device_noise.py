"""Noise made on a torch device, in nanoseconds per normal, side by side in one run.

    python benchmarks/device_noise.py --device cuda --dims 1000000 10000000 --repeats 20

Rows for every ``d`` (median over ``--repeats`` rounds; in each round every row runs once,
so every row sees the same machine state; CUDA work is synchronized before a clock is read):

* ``keystream, torch ops`` / ``keystream, fused Triton`` — the ChaCha20 words of one float32
  row (``1.5·d`` words) by :func:`~flwr_corrnoise.torch.device_noise.chacha20_blocks`'s two
  ways (the fused kernel only where Triton runs on the device);
* ``DeviceGaussian row, float32 / float64`` — the library's row (:class:`DeviceGaussian`,
  keystream and Box–Muller on the device, the default way), what a device stream draws;
* ``same, keystream by torch ops`` — the row with the fused kernel turned off;
* ``torch.randn float32 / float64`` — torch's own generator on the device (Philox, neither
  keyed from OS entropy nor a cipher: the scale, not an alternative);
* ``TorchNoiseStream blt, next()`` — one step of a BLT device stream (draw, recurrence).

Every number is ns per normal (time ÷ d)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from flwr_corrnoise.torch import device_noise as dn
from flwr_corrnoise.torch.device_noise import DeviceGaussian
from flwr_corrnoise.torch.streams import TorchNoiseStream


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rows(d: int, device: torch.device, fused: bool) -> dict[str, Callable[[], object]]:
    """name → one draw of ``d`` normals (or their words) that way."""
    key = bytes(range(32))
    words = 3 * ((d + 1) // 2)
    blocks = -(-words // 16)
    gen = DeviceGaussian(key, device=device)
    out: dict[str, Callable[[], object]] = {
        "keystream, torch ops": lambda: dn.chacha20_blocks(key, (1, 0, 0), 0, blocks, device,
                                                           False),
    }
    if fused:
        out["keystream, fused Triton"] = lambda: dn.chacha20_blocks(key, (1, 0, 0), 0, blocks,
                                                                    device, True)
    out["DeviceGaussian row, float32"] = lambda: gen.next_row(d, torch.float32)
    out["DeviceGaussian row, float64"] = lambda: gen.next_row(d, torch.float64)
    if fused:
        def ops_row() -> torch.Tensor:
            saved = dn.fused_available
            dn.fused_available = lambda _device: False  # type: ignore[assignment]
            try:
                return gen.next_row(d, torch.float32)
            finally:
                dn.fused_available = saved  # type: ignore[assignment]

        out["same float32, keystream by torch ops"] = ops_row
    tg = torch.Generator(device=device).manual_seed(0)
    out["torch.randn float32"] = lambda: torch.randn(d, generator=tg, device=device)
    out["torch.randn float64"] = lambda: torch.randn(d, generator=tg, device=device,
                                                     dtype=torch.float64)
    stream = TorchNoiseStream.create("blt", 10**6, d, 1.0, seed=0, device=device,
                                     device_noise=True, dtype=torch.float32)
    out["TorchNoiseStream blt float32, next()"] = stream.next
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    fused = dn.fused_available(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device noise on {name} ({device}), torch {torch.__version__}, fused Triton "
          f"keystream: {'yes' if fused else 'no'}; median of {args.repeats} rounds")
    print("| d | what | ns per normal |")
    print("|---|---|---|")
    for d in args.dims:
        fns = rows(d, device, fused)
        for fn in fns.values():  # warm-up: allocations, Triton's compile, CUDA's libraries
            fn()
        _sync(device)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                times[k].append(time.perf_counter() - start)
        for k, ts in times.items():
            print(f"| {d:,} | {k} | {1e9 * statistics.median(ts) / d:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
