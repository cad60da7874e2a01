"""App code the SuperNode operator trusts: Ed25519-signed FABs, checked by every SuperNode.

Why: in a Flower deployment the ClientApp's code *and its run-config defaults* arrive from
the server side inside the FAB (Flower App Bundle). For local DP that is the learner's
privacy: code sent by whoever runs ``flwr run`` could ignore the learner's budget. Flower
1.41 lets a SuperNode operator accept only FABs signed by keys the operator trusts:

* ``flower-supernode --trusted-entities FILE.yaml`` (``flwr/supernode/cli/flower_supernode.py``,
  ``_try_obtain_trusted_entities`` / ``_validate_public_keys_ed25519``): a YAML map from
  public-key id to an ``ssh-ed25519`` public key.
* For every new run the SuperNode checks the FAB before storing the run, its context or
  the FAB (``flwr/supernode/start_client_internal.py``, ``_pull_and_store_message`` and
  ``_verify_fab``): the FAB must carry verification records, and one of them must be an
  Ed25519 signature, by a trusted key id, over ``signed_at`` (8 bytes big-endian) followed
  by ``sha256(FAB bytes)`` (``flwr/supercore/primitives/asymmetric_ed25519.py``,
  ``create_message_to_sign``). Otherwise the SuperNode answers the message with an
  ``INVALID_FAB`` error and never installs or runs the FAB.
* The records reach the SuperNode only with FABs the SuperLink fetched from Flower Hub
  (``flwr/superlink/servicer/control/control_handlers.py``, ``_get_remote_fab`` and
  ``_format_verification``; a FAB uploaded by ``flwr run <dir>`` gets none, so a SuperNode
  with trusted entities refuses it). Signatures are made by ``flwr app review``
  (``flwr/cli/app_cmd/review.py``, ``_sign_fab``) and submitted to the Hub.

Flower Hub is on the internet; the SuperLink reads its address from the environment
variable ``FLWR_SUPERGRID_API_URL`` (``flwr/supercore/constant.py``). This module is a
private, Hub-compatible app registry for that variable — ``POST /hub/fetch-fab`` answers
``{"fab_url", "verifications"}`` exactly as ``flwr/supercore/utils.py``'s
``request_download_link`` reads it — plus the publisher's side: an Ed25519 key pair, a
``trusted-entities.yaml`` for the SuperNodes, and signing a FAB the way ``flwr app review``
does. The registry and the SuperLink are *not* trusted by the SuperNodes: they can refuse
to serve an app, but they cannot make a SuperNode run bytes the publisher did not sign.

Command line (see docs/deployment.md, "App code the operator trusts")::

    python -m deploy.trusted_apps keygen  KEY_DIR   # publisher.key/.pub, trusted-entities.yaml
    python -m deploy.trusted_apps publish APP_DIR --key KEY_DIR/publisher.key --registry REG_DIR
    python -m deploy.trusted_apps serve   --registry REG_DIR --port 9300
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import get_fab_config, get_metadata_from_config
from flwr.supercore.primitives.asymmetric_ed25519 import (
    create_message_to_sign,
    load_private_key,
    sign_message,
)

PUBLISHER = "publisher"
TRUSTED_ENTITIES = "trusted-entities.yaml"
INDEX = "index.json"


# -- the publisher's keys -------------------------------------------------------------
def key_id(public_key: ed25519.Ed25519PublicKey) -> str:
    """A stable id for a public key (``fpk_`` like Flower Hub's ids, from its bytes), so
    a trusted-entities file can be checked by eye against the key it names."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "fpk_" + hashlib.sha256(raw).hexdigest()[:32]


def public_key_line(public_key: ed25519.Ed25519PublicKey, comment: str = "") -> str:
    line = public_key.public_bytes(serialization.Encoding.OpenSSH,
                                   serialization.PublicFormat.OpenSSH).decode("ascii")
    return f"{line} {comment}".strip()


def generate_publisher_key(directory: str | os.PathLike[str], name: str = PUBLISHER) -> str:
    """Write ``<name>.key`` (OpenSSH Ed25519 private key, mode 0600, what ``flwr app
    review`` reads) and ``<name>.pub``; return the key id."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    private = ed25519.Ed25519PrivateKey.generate()
    key_path = d / f"{name}.key"
    key_path.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
    key_path.chmod(0o600)
    kid = key_id(private.public_key())
    (d / f"{name}.pub").write_text(public_key_line(private.public_key(), kid) + "\n")
    return kid


def load_public_key(path: str | os.PathLike[str]) -> ed25519.Ed25519PublicKey:
    key = serialization.load_ssh_public_key(Path(path).read_bytes())
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key (Flower accepts only Ed25519)")
    return key


def write_trusted_entities(path: str | os.PathLike[str],
                           public_keys: list[str | os.PathLike[str]]) -> dict[str, str]:
    """The SuperNode operator's ``--trusted-entities`` file: key id -> ``ssh-ed25519 ...``
    for each public key file given (the publishers or reviewers this operator trusts).

    Refuses an empty list: flower-supernode treats an empty map as "no trusted entities"
    and then runs *any* FAB (``if trusted_entities:`` in ``_pull_and_store_message``)."""
    if not public_keys:
        raise ValueError("no public keys: an empty trusted-entities file turns the check off")
    entities = {}
    for pub in public_keys:
        key = load_public_key(pub)
        entities[key_id(key)] = public_key_line(key)
    Path(path).write_text(yaml.safe_dump(entities, sort_keys=True))
    return entities


# -- FABs and signatures --------------------------------------------------------------
def build_fab(app_dir: str | os.PathLike[str]) -> bytes:
    """The FAB ``flwr build`` / ``flwr run`` would make from ``app_dir``."""
    return build_fab_from_disk(Path(app_dir))


def fab_app(fab: bytes) -> tuple[str, str]:
    """``("@publisher/name", "x.y.z")`` from the FAB's own ``pyproject.toml``."""
    fab_id, version = get_metadata_from_config(get_fab_config(fab))
    return f"@{fab_id}", version


def sign_fab(fab: bytes, private_key: str | os.PathLike[str],
             signed_at: int | None = None, public_key_id: str | None = None) -> dict[str, Any]:
    """One verification record for ``fab``, as Flower Hub hands it to the SuperLink: an
    Ed25519 signature over ``signed_at || sha256(fab)`` (``flwr app review``'s format).
    ``public_key_id`` defaults to the signing key's own id; tests pass another to show
    that claiming a trusted id with an untrusted key does not work."""
    key = load_private_key(Path(private_key))
    signed_at = int(time.time()) if signed_at is None else int(signed_at)
    message = create_message_to_sign(hashlib.sha256(fab).digest(), signed_at)
    signature = sign_message(key, message)
    return {"public_key_id": public_key_id or key_id(key.public_key()),
            "signature": base64.urlsafe_b64encode(signature).rstrip(b"=").decode("ascii"),
            "signed_at": signed_at}


# -- the registry ---------------------------------------------------------------------
class AppRegistry:
    """A directory of published FABs with their verification records, served over HTTP
    with Flower Hub's ``/hub/fetch-fab`` protocol.

    Layout: ``<root>/<sha256>.fab`` and ``<root>/index.json`` = ``{app_id: {version:
    {"fab": sha256, "verifications": [...]}}}``. :meth:`publish` does not check the
    records: the SuperNodes do, which is the point (tests publish tampered FABs on purpose).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def index(self) -> dict[str, dict[str, dict[str, Any]]]:
        path = self.root / INDEX
        return json.loads(path.read_text()) if path.exists() else {}

    def publish(self, fab: bytes, verifications: list[dict[str, Any]]) -> str:
        """Store ``fab`` under the app id and version in its ``pyproject.toml``; return the
        app spec ``@publisher/name==x.y.z`` for ``flwr run``."""
        app_id, version = fab_app(fab)
        digest = hashlib.sha256(fab).hexdigest()
        with self._lock:
            (self.root / f"{digest}.fab").write_bytes(fab)
            index = self.index()
            index.setdefault(app_id, {})[version] = {"fab": digest,
                                                     "verifications": list(verifications)}
            tmp = self.root / (INDEX + ".tmp")
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            tmp.replace(self.root / INDEX)
        return f"{app_id}=={version}"

    def lookup(self, app_id: str, version: str | None) -> dict[str, Any] | None:
        versions = self.index().get(app_id, {})
        if version is None and versions:
            version = max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
        return versions.get(version) if version else None

    # HTTP
    @property
    def url(self) -> str:
        """What the SuperLink's ``FLWR_SUPERGRID_API_URL`` must be."""
        if self._server is None:
            raise RuntimeError("the registry is not serving")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> AppRegistry:
        """Serve in a daemon thread (stop with :meth:`close`)."""
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: tests read their own logs
                pass

            def _reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/hub/fetch-fab":
                    self._reply(404, b'{"detail": "not found"}')
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    app_id, version = str(body["app_id"]), body.get("app_version")
                except (ValueError, KeyError, TypeError):
                    self._reply(400, b'{"detail": "bad request"}')
                    return
                entry = registry.lookup(app_id, version)
                if entry is None:
                    versions = sorted(registry.index().get(app_id, {}))
                    detail = {"available_app_versions": versions} if versions else "not found"
                    self._reply(404, json.dumps({"detail": detail}).encode())
                    return
                answer = {"fab_url": f"{registry.url}/fabs/{entry['fab']}.fab",
                          "verifications": entry["verifications"]}
                self._reply(200, json.dumps(answer).encode())

            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                path = registry.root / name
                if (not self.path.startswith("/fabs/") or not name.endswith(".fab")
                        or "/" in name or not path.is_file()):
                    self._reply(404, b'{"detail": "not found"}')
                    return
                self._reply(200, path.read_bytes(), "application/octet-stream")

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="app-registry")
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keygen", help="publisher key pair and a trusted-entities.yaml")
    k.add_argument("key_dir")
    t = sub.add_parser("trust", help="write a trusted-entities.yaml from public keys")
    t.add_argument("out")
    t.add_argument("public_keys", nargs="+")
    s = sub.add_parser("publish", help="build APP_DIR's FAB, sign it, put it in a registry")
    s.add_argument("app_dir")
    s.add_argument("--key", required=True, help="the publisher's Ed25519 OpenSSH private key")
    s.add_argument("--registry", required=True)
    v = sub.add_parser("serve", help="serve a registry for FLWR_SUPERGRID_API_URL")
    v.add_argument("--registry", required=True)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=9300)
    args = p.parse_args(argv)
    if args.cmd == "keygen":
        kid = generate_publisher_key(args.key_dir)
        write_trusted_entities(Path(args.key_dir) / TRUSTED_ENTITIES,
                               [Path(args.key_dir) / f"{PUBLISHER}.pub"])
        print(f"{kid}: {args.key_dir}/{PUBLISHER}.key (keep private), {PUBLISHER}.pub, "
              f"{TRUSTED_ENTITIES} (for flower-supernode --trusted-entities)")
    elif args.cmd == "trust":
        print("\n".join(write_trusted_entities(args.out, args.public_keys)))
    elif args.cmd == "publish":
        fab = build_fab(args.app_dir)
        spec = AppRegistry(args.registry).publish(fab, [sign_fab(fab, args.key)])
        print(f"{spec} sha256={hashlib.sha256(fab).hexdigest()}")
    else:
        reg = AppRegistry(args.registry).serve(args.host, args.port)
        print(f"serving {args.registry}: FLWR_SUPERGRID_API_URL={reg.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            reg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
