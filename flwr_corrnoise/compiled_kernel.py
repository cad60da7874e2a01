"""The compiled transform of the noise kernel: built on first use, bit-identical to NumPy.

Why compiled: a Box–Muller pair in NumPy is ≈ 35 passes over memory (each ufunc one loop),
and NumPy's float32 ``log``/``cos``/``sin`` cost 2.6 ns an element on the AVX2 machine
measured, so the NumPy kernel drew a float32 normal in ≈ 5.4 ns and a float64 one in
≈ 10.9 ns; issue 34 asks for 2.5 and 5. One fused C loop over the same steps
(``noise_kernel.c`` beside this module) does it in ≈ 1.7–2.0 / 3.2–3.7 ns of transform
(docs/benchmarks.md, "Issue 34, fifth pass").

Why it can be optional without changing a single noise value: the transform
(:mod:`flwr_corrnoise.cipher_noise`, "transform 2") uses only IEEE-754 operations that NumPy
performs the same way, in the same order, with no FMA contraction and no libm call, so the C
loop and the NumPy passes give the same floats bit for bit (tests check both against a
scalar reference). A learner without a C compiler (an edge device, a locked-down
container) runs the NumPy path and sends exactly the noise it would have sent with one. The
same holds for the library's other loops here: BLT's recurrence (``cn_blt_steps32/64``,
:meth:`~flwr_corrnoise.mechanisms.streaming.NumpyOps.blt_step`), the clip's norms
(``cn_sumsq32/64``, :func:`~flwr_corrnoise.learner.row_sums_of_squares`) and its scaling
(``cn_scale32/64``, :func:`~flwr_corrnoise.learner.scale_rows`), each one defined
order of IEEE operations on both paths.

How it is built: the first process that needs it compiles ``noise_kernel.c`` with the
system's C compiler (``$CC``, else ``cc``/``gcc``; ``-O3 -march=native -ffp-contract=off``)
into ``$FLWR_CORRNOISE_KERNEL_CACHE`` (default ``~/.cache/flwr_corrnoise/kernel``, under
``$XDG_CACHE_HOME`` when set; its own variable, not the factorizations' ``FLWR_CORRNOISE_CACHE``,
so that pointing that one elsewhere does not rebuild the kernel in every process), named by a hash
of the source, the flags, the compiler and the CPU, written to a temporary file and renamed
into place (so Ray workers starting together never load a half-written file), and loaded
with :mod:`ctypes`. Nothing is downloaded; no Python headers or OpenSSL headers are needed.

``FLWR_CORRNOISE_KERNEL=numpy`` turns it off (the NumPy path); ``=compiled`` makes a build
failure an error instead of a fallback. :func:`status` says which path runs and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("noise_kernel.c")
#: -ffp-contract=off: no FMA (it would change the last bit against NumPy); -fno-math-errno:
#: sqrt becomes one instruction (the argument is never negative: clamped at 0)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
ENV_CHOICE = "FLWR_CORRNOISE_KERNEL"
ENV_CACHE = "FLWR_CORRNOISE_KERNEL_CACHE"

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
#: the loaded library, or None (the NumPy path); whether loading was tried; why; the choice
#: made by :func:`select` (None: the environment's)
_DLL: ctypes.CDLL | None = None
_LOADED = False
_WHY = "not loaded yet"
_CHOICE: str | None = None
#: the ``init`` functions run on the loaded library (:func:`kernel`)
_INITED: set[Callable[[ctypes.CDLL], None]] = set()
#: whether the library has the whole-row function (built against OpenSSL's libcrypto)
HAS_ROW = False
#: link options tried in order: the development symlink, then the runtime libraries, then
#: none (the transform alone: the keystream comes from ``cryptography`` chunk by chunk)
_LINKS = (("row", "-lcrypto"), ("row", "-l:libcrypto.so.3"), ("row", "-l:libcrypto.so.1.1"),
          ("bare", "-DCN_NO_OPENSSL"))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    return None


def _cpu_identity() -> str:
    """The CPU's model and flags (``-march=native`` code must not run on another CPU that
    shares the cache folder, e.g. a home directory on a network file system)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cache_folder() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get(ENV_CACHE, default / "flwr_corrnoise" / "kernel"))


def _check_private(*paths: Path) -> None:
    """Refuse a library someone else could have written: loading it runs its code in the
    learner, beside its noise key. The folder and the file must be this user's and not
    writable by group or others (a shared ``FLWR_CORRNOISE_KERNEL_CACHE`` is refused, not used)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for path in paths:
        st = path.stat()
        if (uid is not None and st.st_uid != uid) or st.st_mode & 0o022:
            raise RuntimeError(f"{path} is writable by another user: not loaded")


def _build() -> tuple[ctypes.CDLL, bool]:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    digest = hashlib.sha256(b"\0".join(
        [source, " ".join(FLAGS).encode(), version.encode(), _cpu_identity().encode(),
         platform.machine().encode()])).hexdigest()[:20]
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    errors = []
    for kind, link in _LINKS:
        target = folder / f"noise_kernel-{digest}-{kind}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            try:
                done = subprocess.run([*cc.split(), *FLAGS, "-o", tmp, str(SOURCE), link],
                                      capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    errors.append(f"{link}: {done.stderr.strip()[-300:]}")
                    continue
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        _check_private(folder, target)
        try:
            dll = ctypes.CDLL(str(target))
        except OSError as exc:  # e.g. libcrypto.so.3 not found at run time
            errors.append(str(exc))
            continue
        break
    else:
        raise RuntimeError(f"{cc} failed: {'; '.join(errors)}")
    p, size = ctypes.c_void_p, ctypes.c_size_t
    dll.cn_init.argtypes = [p] * 8
    dll.cn_init.restype = None
    dll.cn_rows.argtypes = [p, size, size, size, p, p, size, size, ctypes.c_uint, ctypes.c_int]
    dll.cn_rows.restype = ctypes.c_int
    for name in ("cn_blt_steps32", "cn_blt_steps64"):
        getattr(dll, name).argtypes = [p, size, p, size, p, size, p, p, size, size, size]
        getattr(dll, name).restype = None
    for name in ("cn_sumsq32", "cn_sumsq64", "cn_scale32", "cn_scale64"):
        getattr(dll, name).argtypes = [p, size, size, size, p]
        getattr(dll, name).restype = None
    has_row = hasattr(dll, "cn_row")
    if has_row:
        dll.cn_row.argtypes = [ctypes.c_char_p, ctypes.c_char_p, size, ctypes.c_int, p,
                               ctypes.c_uint, size]
        dll.cn_row.restype = ctypes.c_int
    return dll, has_row


def _choice() -> str:
    choice = (_CHOICE or os.environ.get(ENV_CHOICE, "auto")).strip().lower()
    if choice not in ("auto", "numpy", "compiled"):
        raise ValueError(f"{ENV_CHOICE} is auto, numpy or compiled, not {choice!r}")
    return choice


def prebuild() -> str:
    """Build the library now (if a compiler is there), without making it this process's
    kernel, so that processes started next find it built instead of each compiling its own
    copy (the test session calls it once before its workers start); returns what happened."""
    try:
        _build()
    except Exception as exc:  # the processes will say so themselves, and use NumPy
        return f"not built ({exc})"
    return f"built in {cache_folder()}"


def _load(init: Callable[[ctypes.CDLL], None] | None) -> ctypes.CDLL | None:
    global _DLL, _LOADED, _WHY, HAS_ROW
    with _LOCK:
        if _LOADED:
            return _DLL
        choice = _choice()
        dll, has_row, why = None, False, f"NumPy path: turned off ({ENV_CHOICE}=numpy)"
        _INITED.clear()
        if choice != "numpy":
            try:
                dll, has_row = _build()
                if init is not None:
                    init(dll)
                    _INITED.add(init)
                why = (f"compiled, {'rows with OpenSSL' if has_row else 'transform only'} "
                       f"({cache_folder()})")
            except Exception as exc:  # any build failure means the NumPy path
                if choice == "compiled":
                    raise RuntimeError(f"the compiled noise kernel could not be built: {exc}"
                                       ) from exc
                dll, has_row, why = None, False, f"NumPy path: not built ({exc})"
                log.warning("flwr-corrnoise: the noise kernel is not compiled (%s); drawing "
                            "in NumPy instead: the same noise, about 4x slower (install a C "
                            "compiler, or set %s=numpy to silence this)", exc, ENV_CHOICE)
        _DLL, HAS_ROW, _WHY, _LOADED = dll, has_row, why, True
        return dll


def kernel(init: Callable[[ctypes.CDLL], None] | None = None) -> ctypes.CDLL | None:
    """The loaded library, ``init`` run on it once (the draws' tables and constants; the
    recurrence needs none), or ``None`` for the NumPy path. Decided once a process (a
    function call on every chunk must stay cheap); :func:`select` decides again."""
    dll = _DLL if _LOADED else _load(init)
    if dll is not None and init is not None and init not in _INITED:
        with _LOCK:
            if init not in _INITED:
                init(dll)
                _INITED.add(init)
    return dll


def select(choice: str | None) -> None:
    """Choose the path again on the next draw: ``"numpy"``, ``"auto"``, ``"compiled"``, or
    ``None`` for the environment's :data:`ENV_CHOICE` (the tests run both paths in one
    process; the noise is the same either way)."""
    global _CHOICE, _LOADED, _DLL, HAS_ROW
    with _LOCK:
        _CHOICE, _LOADED, _DLL, HAS_ROW = choice, False, None, False


@contextlib.contextmanager
def numpy_path() -> Iterator[None]:
    """The NumPy path for the draws inside the block, the compiled one (if loaded) after it,
    without a rebuild (benchmarks put both paths side by side in one round-robin)."""
    global _DLL, HAS_ROW, _LOADED, _WHY
    with _LOCK:
        saved = _DLL, HAS_ROW, _LOADED, _WHY
        _DLL, HAS_ROW, _LOADED, _WHY = None, False, True, "NumPy path (numpy_path())"
    try:
        yield
    finally:
        with _LOCK:
            _DLL, HAS_ROW, _LOADED, _WHY = saved


def status() -> str:
    """Which path the kernel runs in this process, and why."""
    return _WHY


def addr(a: np.ndarray) -> int:
    """The address of an array's first element (for a ctypes call)."""
    return a.__array_interface__["data"][0]
