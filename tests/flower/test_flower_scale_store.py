"""Issue 22's stores at toy size: Ray's object store beside the file offload
(``benchmarks/state_handling.py --ray``), and the split of one learner message
(``benchmarks/flower_scale.py --message-profile``). A float32 model's learners keeping
float32 states through a whole Flower simulation is ``tests/experiments/test_benchmarks.py::
test_flower_scale``. Timings are not compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.flower_helpers import RAY, ray_head

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> tuple[str, list[list[str]]]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in proc.stdout.splitlines() if line.startswith("| ")]
    return proc.stdout, rows


@pytest.mark.slow  # Ray: the test worker's head, or a local Ray instance (≈ 10 s)
def test_state_handling_measures_rays_object_store() -> None:
    """Three stores per d; the object store, like the file, leaves the driver a handle of
    under 1 KB whatever d (an object id), where ``context.state`` keeps ≥ 4·d floats. On
    the test worker's Ray head where there is one (``--ray-address``: no Ray start-up)."""
    head = ["--ray-address", ray_head().address] if RAY.exists() else []
    out, rows = run("state_handling.py", "--dims", "2000", "20000", "--repeats", "2",
                    "--ray", "--dtype", "float32", *head)
    assert "float32 buffers" in out
    body = {(r[0], r[1]): r for r in rows[1:]}
    stores = ("in context.state", "offloaded to a file", "in Ray's object store")
    assert set(body) == {(d, s) for d in ("2,000", "20,000") for s in stores}
    for d in ("2,000", "20,000"):
        for store in stores[1:]:
            assert body[(d, store)][6].endswith(" B")
            assert all(float(body[(d, store)][i]) >= 0 for i in (2, 3, 4, 5))
        kept = body[(d, "in context.state")][6]
        assert kept.endswith("KB") and float(kept.split()[0]) * 1e3 >= 4 * 4 * int(
            d.replace(",", ""))


@pytest.mark.slow
def test_message_profile_splits_a_train_message() -> None:
    """``flower_scale.py --message-profile``: one row per (d, dtype); the named parts and
    "other" add up to the profiled message (the recurrence is counted without its draws),
    each part counted once — none larger than the message, "other" not negative
    (``part_seconds``: session.py's two nested ``commit`` functions were once summed)."""
    _, rows = run("flower_scale.py", "--dims", "3000", "--message-profile", "2")
    header, body = rows[0], rows[1:]
    assert [(r[0], r[1]) for r in body] == [("3,000", "float64"), ("3,000", "float32")]
    for r in body:
        values = dict(zip(header[2:], (float(v) for v in r[2:]), strict=True))
        assert values["message ms"] > 0 and values["noise: draws"] > 0
        summed = [v for k, v in values.items() if k not in ("message ms",
                                                            "profiled message ms")]
        # every figure is printed to 0.1 ms: each part and the total may be off by 0.05
        assert sum(summed) == pytest.approx(values["profiled message ms"],
                                            abs=0.05 * (len(summed) + 1) + 1e-9)
        named = [v for k, v in values.items() if k not in ("message ms", "other",
                                                            "profiled message ms")]
        assert all(0 < v < values["profiled message ms"] for v in named)
        assert values["other"] >= 0
