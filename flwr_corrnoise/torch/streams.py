"""Device-resident noise streams for PyTorch: the increments never leave the model's device.

:class:`TorchNoiseStream` is :class:`~flwr_corrnoise.streams.NoiseStream` with a
``torch.Generator`` on the model's device and its state in tensors of the model's dtype
(float32 by default, float64 on request). The recurrence is not re-implemented: both
streams run the mechanism's one :class:`~flwr_corrnoise.mechanisms.streaming.StreamKernel`
over their array namespace (:class:`TorchOps` here), so the NumPy and the torch stream
release the same law — and on the CPU the same floats, bit for bit (the same draws, the
same float32 std rounded up, BLT's recurrence by the host kernel on the tensors' memory;
``tests/torch/test_torch_streams.py``).

Where the normals come from, by the stream's device (issue 34, item 3):

* **on a CUDA device: on the device** — :class:`~flwr_corrnoise.torch.device_noise.DeviceGaussian`,
  ChaCha20 (RFC 8439; on CUDA one fused Triton kernel, elsewhere torch integer ops, the same
  words) and Box–Muller in torch float ops, so no row
  crosses the bus; the same key policy (256 bits of OS entropy, or for a reproducible
  simulation a hash of every bit of the seed) and rows by counter (row ``t`` of the
  generator is step ``t``'s ``ξ``, so a regenerating mechanism, ``banded-inverse``, goes
  back rows by moving the counter as on the host). ``device_noise=`` in :meth:`create`
  chooses it anywhere (on a CPU it runs the same code on CPU tensors, which the tests
  check bit for bit against the transform of OpenSSL's ChaCha20 keystream); its state is
  the generator's six words (key, row) and continues bit for bit on any device of the
  same type (CPU and GPU ``log``/``cos``/``sin`` may differ in the last bit);
* **on the CPU (the default there)**: the same 128-bit-keyed generator as the NumPy
  stream (the AES-128-CTR kernel of :mod:`~flwr_corrnoise.cipher_noise` since noise-state
  format 3; a restored format-2 stream continues its keyed Philox), drawn on the host in
  the stream's dtype (no copy, ``torch.from_numpy``) — AES-NI makes it the faster one
  there. Why not
torch's generators: the CPU one (Mersenne Twister) keeps 32 bits of its seed and its
outputs reveal its state, the CUDA one (Philox4x32) takes a 64-bit key; a learner's seed
was recovered from one release by a 2³² search. So a torch stream and a NumPy stream of
the same seed and dtype draw the same ``ξ`` (float64: bit for bit; a test checks it), and
a host-drawn stream's state holds no device-specific generator: it continues on the CPU or
a GPU. Both paths ran on an H200 (``benchmarks/device_check.sh``: the CUDA tests of
``tests/noise/test_device_noise.py`` and the torch suites; docs/benchmarks.md). The
buffers and counters serialize to the same array dict as the NumPy stream's (plus
``backend``, ``dtype`` and ``device`` keys), and a restored stream continues bit for bit.

Secure noise (ChaCha20 on a power-of-two grid, :mod:`~flwr_corrnoise.secure_noise`) is
NumPy-only: a deployment that needs it uses the host stream.

Needs the ``torch`` extra; nothing in the core imports this module. Importing it registers
the ``"torch"`` backend with :func:`~flwr_corrnoise.streams.restore_stream`, so a learner
state holding a torch stream can be read once any part of :mod:`flwr_corrnoise.torch` is
imported (the package's ``__init__`` imports this module). Formerly
``flwr_corrnoise.torch_streams``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import arraypack
from ..cipher_noise import CipherGaussian
from ..mechanisms import Factorization
from ..mechanisms.streaming import numpy_ops
from ..streams import (
    NoiseStream,
    Shapes,
    normalize_shapes,
    register_generator,
    register_stream_backend,
    unpack_rng,
)
from .device_noise import STATE_TAG as DEVICE_TAG
from .device_noise import DeviceGaussian
from .params import host_memory

__all__ = ["TorchNoiseStream", "TorchOps"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class TorchOps:
    """:class:`~flwr_corrnoise.mechanisms.streaming.ArrayOps` for tensors of one dtype on
    one device. No column chunking: on a GPU it would only add kernel launches, and on a
    CPU torch's own kernels are already blocked."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device

    def zeros(self, rows: int, dim: int) -> torch.Tensor:
        return torch.zeros(rows, dim, dtype=self.dtype, device=self.device)

    def empty(self, rows: int, dim: int) -> torch.Tensor:
        return torch.empty(rows, dim, dtype=self.dtype, device=self.device)

    def const(self, values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(self.device, self.dtype)

    def copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def subtract(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.sub(a, b, out=out)

    def sub_matvec(self, e: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> None:
        # one gemv over the k×d buffers (``w @ r`` takes a slower path and a temporary)
        torch.addmv(e, r.t(), w, alpha=-1, out=e)

    def blt_step(self, r: torch.Tensor, theta: torch.Tensor, omega: torch.Tensor,
                 e: torch.Tensor, out: torch.Tensor) -> None:
        """On the CPU, the host stream's recurrence on the tensors' memory
        (:meth:`~flwr_corrnoise.mechanisms.streaming.NumpyOps.blt_step`: the compiled
        kernel's one pass over the buffers, or NumPy's chunks, the same floats either way),
        so a torch stream's increments equal the NumPy stream's bit for bit in either
        dtype. Why: torch's ``addmv`` + ``addcmul`` took ≈ 0.47 ms a step of the paper CNN
        (d = 305,194, float32) against ≈ 0.15 for the compiled pass (docs/benchmarks.md,
        "Issue 34, tenth pass"). On another device: ``e −= ω·r`` as one gemv, then
        ``out = θ⊙r + e``."""
        if self.device.type == "cpu" and host_memory(r, theta, omega, e, out):
            rn = r.numpy()
            numpy_ops(rn.dtype).blt_step(rn, theta.numpy(), omega.numpy(), e.numpy(),
                                         out.numpy())
            return
        self.sub_matvec(e, omega, r)
        torch.addcmul(e, r, theta, out=out)  # one pass over the buffers instead of two


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one (torch compares
    them unequal: a tensor made on ``cuda`` reports ``cuda:0``)."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else None
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current)
    return a.index == b.index


class TorchNoiseStream(NoiseStream):
    """A noise stream whose increments are tensors on ``device`` in ``dtype``.

    >>> s = TorchNoiseStream.create("blt", horizon=8, dim=[(2, 3), (3,)], std=1.0, seed=1)
    >>> e0 = s.next()                      # a float32 tensor of length 9, on the CPU
    >>> restored = TorchNoiseStream.from_bytes(s.to_bytes())
    >>> bool(torch.equal(s.next(), restored.next()))
    True
    """

    def __init__(
        self,
        mechanism: str,
        horizon: int,
        shapes: Shapes,
        std: float,
        rng: np.random.Generator,
        step: int = 0,
        *,
        device: torch.device | str = "cpu",
        levels: list[int] | None = None,
        rows: Sequence[np.ndarray] | np.ndarray | None = None,
        factorization: Factorization | None = None,
        dtype: torch.dtype = torch.float32,
        adopt_rows: bool = False,
    ) -> None:
        if dtype not in _DTYPES.values():
            raise ValueError(f"a torch noise stream is float32 or float64, not {dtype}")
        self.dtype = dtype
        self.device = torch.device(device)
        self._np_dtype = np.dtype(str(dtype).removeprefix("torch."))
        self._ops = TorchOps(dtype, self.device)  # type: ignore[assignment]
        if isinstance(rng, DeviceGaussian):  # its rows are made where the stream's state is
            rng.device = self.device
        if (adopt_rows and isinstance(rows, np.ndarray) and rows.ndim == 2
                and rows.dtype == self._np_dtype and rows.flags.c_contiguous
                and rows.flags.writeable and rows.flags.aligned):
            # a fresh array of all the rows (from_bytes): the kernel may keep it as its
            # buffer, a view on the CPU (BLT) — no copy per row, no stack
            rows = torch.from_numpy(rows).to(self.device)  # type: ignore[assignment]
        super().__init__(mechanism, horizon, shapes, std, rng, step, levels,
                         rows, factorization, adopt_rows=adopt_rows)  # type: ignore[arg-type]

    def _adoptable(self, rows: object) -> bool:  # type: ignore[override]
        """A ``rows × d`` tensor of the stream's dtype on its device, contiguous, for a
        kernel that keeps its rows as one array (BLT)."""
        return (self._kernel.adopts_rows and isinstance(rows, torch.Tensor) and rows.ndim == 2
                and rows.shape[1] == self.dim and rows.dtype == self.dtype
                and _same_device(rows.device, self.device) and rows.is_contiguous())

    @classmethod
    def create(  # type: ignore[override]
        cls,
        mechanism: str,
        horizon: int,
        dim: int | Sequence[Sequence[int]],
        std: float,
        seed: int | None = None,
        secure: bool = False,
        factorization: Factorization | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        device_noise: bool | None = None,
    ) -> TorchNoiseStream:
        """A fresh stream at step 0 on ``device``; ``seed=None`` draws a key from OS
        entropy. ``device_noise``: draw on the device (ChaCha20 in torch ops,
        :class:`~flwr_corrnoise.torch.device_noise.DeviceGaussian`) rather than on the
        host (AES-128-CTR); by default on a CUDA device, not on the CPU."""
        if secure:
            raise ValueError("secure noise (ChaCha20 on a grid) is NumPy-only; use "
                             "NoiseStream.create(..., secure=True) on the host")
        if seed is not None and int(seed) < 0:
            raise ValueError("the seed must be a non-negative integer")
        dev = torch.device(device)
        if device_noise is None:
            device_noise = dev.type == "cuda"
        gen: CipherGaussian | DeviceGaussian
        if device_noise:  # ChaCha20, a 256-bit key: OS entropy, or every bit of the seed
            gen = DeviceGaussian.from_seed(None if seed is None else int(seed), device=dev)
        else:  # AES-128 on the host
            gen = CipherGaussian.from_seed(None if seed is None else int(seed))
        return cls(mechanism, horizon, normalize_shapes(dim), std, gen, device=device,
                   dtype=dtype, factorization=factorization)

    def _as_row(self, row: np.ndarray | torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if isinstance(row, torch.Tensor):  # a row of restored rows already on a device
            if row.dtype != self.dtype:
                raise ValueError(f"a {self.dtype} stream got a {row.dtype} state row")
            return row.to(self.device, copy=True)
        arr = np.asarray(row)
        if arr.dtype != np.dtype(str(self.dtype).removeprefix("torch.")):
            raise ValueError(f"a {self.dtype} stream got a {arr.dtype} state row")
        return torch.from_numpy(arr.copy()).to(self.device)

    def _draw(self) -> torch.Tensor:  # type: ignore[override]
        if isinstance(self._rng, DeviceGaussian):  # made on the stream's device
            return self._rng.next_row(self.dim, self.dtype)
        # the keyed draw on the host, in the stream's dtype (the NumPy stream's row); on the
        # CPU a view
        if isinstance(self._rng, CipherGaussian):
            host = self._rng.next_row(self.dim, self._np_dtype,  # small rows several a call
                                      ahead=self.horizon - self.step)
        else:  # a keyed Philox stream of format 2, continued as it began
            host = self._rng.standard_normal(self.dim, dtype=self._np_dtype)
        row = torch.from_numpy(host)
        return row if self.device.type == "cpu" else row.to(self.device)

    def next(self) -> torch.Tensor:  # type: ignore[override]
        """The flat increment ``e[step]`` (length ``d``, a tensor on the stream's device)."""
        return super().next()  # type: ignore[return-value]

    @property
    def device_noise(self) -> bool:
        """Whether the normals are made on the device (:class:`DeviceGaussian`)."""
        return isinstance(self._rng, DeviceGaussian)

    def fork(self) -> TorchNoiseStream:  # type: ignore[override]
        """:meth:`NoiseStream.fork`; a device generator's copy stays on the device."""
        twin = super().fork()
        if isinstance(self._rng, DeviceGaussian):
            self._rng.device = self.device
        return twin  # type: ignore[return-value]

    # -- state ---------------------------------------------------------------------------
    def _rows_view(self, view: object) -> np.ndarray | None:  # type: ignore[override]
        """The kernel's rows tensor as NumPy: a view on the CPU, one copy from a GPU."""
        if isinstance(view, torch.Tensor) and view.is_contiguous():
            return view.detach().cpu().numpy()
        return None

    def _rows_array(self, saved: list) -> np.ndarray:  # type: ignore[override]
        np_dtype = np.dtype(str(self.dtype).removeprefix("torch."))
        if not saved:
            return np.zeros((0, self.dim), dtype=np_dtype)
        return np.stack([r.detach().cpu().numpy() for r in saved])

    def state_dict(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """The NumPy stream's state keys (rows in the stream's dtype, the generator's
        state as bytes) plus ``backend``, ``dtype`` and ``device`` (the device type).
        ``copy=False``: on the CPU, BLT's ``rows`` is a view of its buffer tensor."""
        state = super().state_dict(copy=copy)
        state.update({
            "backend": np.array("torch"),
            "dtype": np.array(str(self.dtype).removeprefix("torch.")),
            "device": np.array(self.device.type),
            "secure": np.array(False),
        })
        return state

    @classmethod
    def from_state_dict(  # type: ignore[override]
        cls, state: dict[str, np.ndarray], device: torch.device | str | None = None,
        *, adopt: bool = False,
    ) -> TorchNoiseStream:
        """Rebuild a stream from :meth:`state_dict` on ``device`` (default: a device of the
        recorded type). A host generator's stream continues bit for bit on any device.
        ``adopt=True``: ``state["rows"]`` is the caller's to give away (fresh arrays, as
        :meth:`from_bytes` unpacks): on the CPU a BLT stream keeps it as its buffer."""
        if str(state.get("backend", "numpy")) != "torch":
            raise ValueError("this is the state of a NumPy noise stream; restore it with "
                             "NoiseStream.from_state_dict")
        try:
            dtype = _DTYPES[str(state["dtype"])]
            recorded = str(state["device"])
            dev = torch.device(recorded if device is None else device)
            if np.asarray(state["rng"]).dtype == np.uint8:  # torch generator (format 1)
                raise ValueError(
                    "this torch noise state holds a torch generator (32/64-bit seed, written "
                    "before keyed generators); its noise may be predictable, so it is not "
                    "continued: start a new learner state")
            gen = unpack_rng(np.asarray(state["rng"]))  # a DeviceGaussian moves to ``dev``
            stream = cls(rng=gen, rows=np.asarray(state["rows"]), dtype=dtype, device=dev,
                         adopt_rows=adopt, **cls._parse_state(state))
        except (KeyError, TypeError, IndexError, RuntimeError) as err:
            raise ValueError(f"malformed torch noise-stream state: {err!r}") from err
        stream._check_consistent()
        return stream

    @classmethod
    def from_bytes(  # type: ignore[override]
        cls, data: bytes, device: torch.device | str | None = None
    ) -> TorchNoiseStream:
        """Inverse of :meth:`to_bytes`."""
        try:
            state = arraypack.unpack(data)
        except (OSError, ValueError, EOFError) as err:
            raise ValueError(f"unreadable noise-stream state: {err}") from err
        return cls.from_state_dict(state, device, adopt=True)  # the unpacked arrays are fresh


register_stream_backend("torch", TorchNoiseStream.from_state_dict)
# the device generator's packed state: tag, 256-bit key (4 words), row — a position is the row
register_generator(DEVICE_TAG, DeviceGaussian.unpack, key_slots=[0, 1, 2, 3, 4])
