"""The ``decentralized`` subcommand, as a user runs it (subprocess) and in-process."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from flwr_corrnoise.cli import main
from flwr_corrnoise.decentralized.chen_wang import StepSizes
from flwr_corrnoise.decentralized.chen_wang_privacy import TIGHT, chen_wang_epsilon


def test_decentralized_json_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flwr_corrnoise.cli", "decentralized", "--algorithm",
         "chen-wang", "--nodes", "5", "--steps", "150", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    eps = out[f"epsilon [{TIGHT}]"]
    assert len(eps) == 5 and out["local-dp"] is True
    # independent: the accountant with the CLI's defaults (ϱ₀ = 1, ς_i = 0.1 + 0.01(i+1),
    # unclipped, declared feature bound 1: C = 2, L = 1/4 + r)
    for i, e in enumerate(eps):
        ref = chen_wang_epsilon(150, StepSizes(1.0, 0.77, 1.0, 0.65), w_self=0.6, L=0.25 + 1e-3,
                                C=2.0, dim=10, noise_scale=1.0, exponent=0.1 + 0.01 * (i + 1))
        assert e == pytest.approx(ref[-1], rel=1e-6)  # declared feature bound B = 1
    # with ε ≈ 100 over 10 coordinates the final accuracy is at the noise's mercy (0.42–0.62
    # over seeds), so only its range is checked here; learning is checked noise-free below
    assert 0.0 <= out["final-accuracy-mean"] <= 1.0


def test_decentralized_learns_without_noise(capsys) -> None:
    assert main(["decentralized", "--algorithm", "chen-wang", "--steps", "150",
                 "--noise-scale", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(math.isinf(e) for e in out[f"epsilon [{TIGHT}]"])  # no noise, no privacy
    assert 0.5 < out["final-accuracy-mean"] <= 1.0


@pytest.mark.parametrize("algorithm", ["dsgd", "dola", "pdop"])
def test_baselines_print_both_accountants(algorithm: str, capsys) -> None:
    assert main(["decentralized", "--algorithm", algorithm, "--steps", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = [k for k in out if k.startswith("epsilon")]
    assert len(keys) == 2 and all(len(out[k]) == 5 for k in keys)
    assert np.isfinite(out["average-online-loss"])


def test_bad_input_is_a_clear_error(capsys) -> None:
    assert main(["decentralized", "--task", "no-such-task", "--steps", "3"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["decentralized", "--nodes", "1", "--steps", "3"]) == 2
    assert main(["decentralized", "--set", "lambda0", "--steps", "3"]) == 2
    with pytest.raises(SystemExit):
        main(["decentralized", "--algorithm", "nope"])
