"""SuperNodes run only app code their operator trusts (Flower 1.41 ``--trusted-entities``).

Why this matters for local DP: the ClientApp's code and its run-config defaults arrive
from the server side inside the FAB; a SuperNode that runs any FAB runs whatever code the
person starting the run chose. With ``flower-supernode --trusted-entities`` a SuperNode
checks, before it stores or installs a new run's FAB, that the FAB carries an Ed25519
signature over its SHA-256 by a key its operator listed (``flwr/supernode/
start_client_internal.py``: ``_pull_and_store_message``, ``_verify_fab``).

The tests here check :mod:`deploy.trusted_apps`'s signatures with the SuperNode's own
verifier (so the format is Flower's, not ours). End to end, on a real TLS deployment
(``flower-superlink``, 3 ``flower-supernode``s, a local Flower-Hub-compatible registry):
``tests/flower/test_deployment.py::test_tls_deployment_survives_a_supernode_crash`` first
shows that an unsigned FAB, a FAB modified after signing, and a FAB signed by an untrusted
key claiming the trusted key's id are each refused by every SuperNode with nothing
installed or written (its ``refuse_untrusted_apps``, with the helpers below), then runs the
signed app to the end through a SuperNode crash.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.supercore.fab import Fab
from flwr.supernode.start_client_internal import _verify_fab

from deploy.local import APP, CONNECTION, LocalDeployment, config_arg, flower_bin
from deploy.trusted_apps import (
    PUBLISHER,
    TRUSTED_ENTITIES,
    build_fab,
    fab_app,
    generate_publisher_key,
    key_id,
    load_public_key,
    sign_fab,
    write_trusted_entities,
)

# `flwr build` (flwr.cli.build) uses a pathspec pattern class that pathspec deprecates
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")

ROUNDS, TAU = 2, 2
LEARNER = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-3, "horizon": ROUNDS * TAU}
#: the SuperNode's own words (flwr/supernode/start_client_internal.py)
UNSIGNED = "App verification is not supported by the connected SuperLink"
BAD_SIGNATURE = "FAB verification failed"


def as_fab(fab: bytes, records: list[dict[str, Any]]) -> Fab:
    """What the SuperNode receives: the SuperLink's ``_format_verification`` of the
    registry's records (``flwr/superlink/servicer/control/control_handlers.py``)."""
    verifications = {r["public_key_id"]: json.dumps({k: v for k, v in r.items()
                                                      if k != "public_key_id"})
                     for r in records}
    verifications["valid_license"] = "Valid"
    return Fab(hashlib.sha256(fab).hexdigest(), fab, verifications)


def variant(src: Path, dst: Path, version: str, epsilon: float) -> Path:
    """A copy of the app with another version and another default ε: a "modified FAB"."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "results"))
    toml = (dst / "pyproject.toml").read_text()
    toml = re.sub(r'(?m)^version = ".*"$', f'version = "{version}"', toml, count=1)
    toml = re.sub(r"(?m)^epsilon = .*$", f"epsilon = {epsilon!r}", toml, count=1)
    (dst / "pyproject.toml").write_text(toml)
    return dst


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    trusted, rogue = tmp_path / "trusted", tmp_path / "rogue"
    generate_publisher_key(trusted)
    generate_publisher_key(rogue)
    entities = write_trusted_entities(tmp_path / TRUSTED_ENTITIES, [trusted / f"{PUBLISHER}.pub"])
    return trusted / f"{PUBLISHER}.key", rogue / f"{PUBLISHER}.key", entities


def test_signatures_are_checked_by_the_supernodes_own_verifier(keys, tmp_path: Path) -> None:
    good_key, rogue_key, entities = keys
    # the trusted-entities file is what flower-supernode reads (a YAML map id -> key)
    loaded = yaml.safe_load((tmp_path / TRUSTED_ENTITIES).read_text())
    assert loaded == entities and len(loaded) == 1
    (kid,) = loaded
    assert kid == key_id(load_public_key(good_key.with_suffix(".pub")))
    assert loaded[kid].startswith("ssh-ed25519 ")

    fab = build_fab(APP)
    assert fab == build_fab(APP)  # deterministic: what is signed is what flwr run builds
    assert fab_app(fab) == ("@flwr-corrnoise/corrnoise-logreg", "0.1.0")
    good = sign_fab(fab, good_key)
    assert good["public_key_id"] == kid
    assert _verify_fab(as_fab(fab, [good]), entities)
    # one trusted record among untrusted ones is enough, as Flower specifies
    assert _verify_fab(as_fab(fab, [sign_fab(fab, rogue_key), good]), entities)

    # a modified FAB (another default ε) under the genuine FAB's signature
    other = build_fab(variant(APP, tmp_path / "app", "0.1.1", 1000.0))
    assert fab_app(other)[1] == "0.1.1" and other != fab
    assert not _verify_fab(as_fab(other, [good]), entities)
    # signed by an untrusted key, under its own id or claiming the trusted one
    assert not _verify_fab(as_fab(fab, [sign_fab(fab, rogue_key)]), entities)
    assert not _verify_fab(as_fab(fab, [sign_fab(fab, rogue_key, public_key_id=kid)]), entities)
    # the timestamp is part of what is signed
    assert not _verify_fab(as_fab(fab, [{**good, "signed_at": good["signed_at"] + 1}]), entities)
    # no records at all: nothing to verify
    assert not _verify_fab(as_fab(fab, []), entities)
    # an empty trusted-entities map would turn flower-supernode's check off: refused here
    with pytest.raises(ValueError, match="empty"):
        write_trusted_entities(tmp_path / "empty.yaml", [])


def test_supernode_refuses_keys_that_are_not_ed25519(tmp_path: Path) -> None:
    """flower-supernode exits at start-up on a trusted-entities file it cannot use, so an
    operator's typo never silently turns verification off."""
    pub = ec.generate_private_key(ec.SECP384R1()).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"fpk_x": pub}))
    res = subprocess.run([flower_bin("flower-supernode"), "--insecure", "--superlink",
                          "127.0.0.1:1", "--trusted-entities", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "Ed25519" in res.stdout + res.stderr
    (tmp_path / "ec.pub").write_text(pub)
    with pytest.raises(ValueError, match="Ed25519"):  # our helper refuses it too
        load_public_key(tmp_path / "ec.pub")


# -- end to end ----------------------------------------------------------------------
def refusals(dep: LocalDeployment, i: int) -> dict[int, str]:
    """Run id -> refusal reason, from SuperNode ``i``'s log (each message it receives is
    logged under ``[RUN <id>...]`` before the SuperNode checks the run's FAB)."""
    out: dict[int, str] = {}
    run = None
    for line in (dep.logs / f"supernode-{i}.log").read_text(errors="replace").splitlines():
        if m := re.search(r"\[RUN (\d+)", line):
            run = int(m.group(1))
        elif run is not None and (UNSIGNED in line or BAD_SIGNATURE in line):
            out[run] = UNSIGNED if UNSIGNED in line else BAD_SIGNATURE
    return out


def start_run(dep: LocalDeployment, app: str, cfg: dict[str, Any]) -> int:
    res = dep.flwr("run", app, CONNECTION, "--run-config", config_arg(cfg), "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    return int(json.loads(res.stdout)["run-id"])


def wait_for(predicate, timeout: float, what: str, dep: LocalDeployment) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(p.name + ":\n" + p.read_text(errors="replace")[-2000:]
                             for p in sorted(dep.logs.glob("*.log")))
            raise TimeoutError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.3)
