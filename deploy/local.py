"""A whole Flower deployment on one machine: a SuperLink and N SuperNodes as real processes.

Why: the deployment guide (``docs/deployment.md``) and the end-to-end tests need the same
thing — real ``flower-superlink`` / ``flower-supernode`` processes talking over Flower's
transport, with TLS and SuperNode authentication or in insecure mode, each SuperNode with
its own partition and its own state directory — and must stop exactly the processes they
started. Every process is started in a new session, so stopping it (``os.killpg`` on its
own pid) also stops the SuperExec and app processes it spawned, and nothing else.

With ``trusted_apps`` (the default of ``--tls``) the SuperNodes run only app code the
operator trusts: each gets ``--trusted-entities`` naming a publisher's Ed25519 key, and the
app reaches the SuperLink signed, through a Flower-Hub-compatible registry
(:mod:`deploy.trusted_apps`); a FAB uploaded unsigned, modified, or signed by another key
is refused by every SuperNode before it is installed.

Flower's executables are started from beside ``sys.executable`` (the environment this
package is installed in), not from ``PATH``; and since ``flower-superlink`` and
``flower-supernode`` start ``flower-superexec`` by name, that folder is put first on the
``PATH`` of every process the deployment starts.

A run that fails says so: ``flwr run`` exits 0 once its run ends, whatever the run's
status, so :meth:`LocalDeployment.outcome` asks the SuperLink (``flwr ls --run-id``) and
``python -m deploy.local`` exits 1 unless the run is ``finished:completed`` (a ServerApp
that raised — e.g. ``RunFailedError`` — leaves it ``finished:failed``).

Run it as a script to try a deployment (``python -m deploy.local --help``)::

    python -m deploy.local --nodes 3 --tls --rounds 5

Everything lives under ``--workdir``: ``flwr-home/`` (the ``flwr`` CLI's configuration, a
``FLWR_HOME`` of its own), ``certs/``, ``state/node-<i>/`` (each learner's state),
``logs/`` and ``results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deploy.trusted_apps import (
    PUBLISHER,
    TRUSTED_ENTITIES,
    AppRegistry,
    build_fab,
    generate_publisher_key,
    sign_fab,
    write_trusted_entities,
)

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "logreg-app"
CERT_SCRIPT = ROOT / "deploy" / "generate-certs.sh"
CONNECTION = "local-deployment"


def flower_bin(name: str) -> str:
    """A Flower executable of *this* environment (beside ``sys.executable``), so a
    deployment never picks up another installation's ``flower-supernode`` from ``PATH``."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{name} is not installed beside {sys.executable}")
    return str(path)


def flower_path() -> str:
    """``PATH`` with this environment's bin folder first: Flower's processes start
    ``flower-superexec`` (and the app processes) by name."""
    return os.pathsep.join([str(Path(sys.executable).parent),
                            *filter(None, [os.environ.get("PATH")])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    """One value as TOML, for ``--node-config`` / ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"


def config_arg(config: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in config.items())


class LocalDeployment:
    """A SuperLink plus ``num_nodes`` SuperNodes on localhost.

    ``node_config(i)`` gives SuperNode ``i``'s node config (``partition-id``,
    ``num-partitions`` and ``state-dir`` are added unless given). With ``tls`` the
    SuperLink serves HTTPS with certificates made by ``deploy/generate-certs.sh`` and
    admits only registered SuperNodes (``--enable-supernode-auth``): each SuperNode has
    its own key pair, so a restarted SuperNode keeps its node id.

    With ``trusted_apps`` every SuperNode gets ``--trusted-entities`` (a publisher key made
    under ``trust/``) and runs only FABs signed by it; :meth:`run_app` then builds the app's
    FAB, signs it, publishes it in a local app registry (``registry/``) that the SuperLink
    uses as its Flower Hub (``FLWR_SUPERGRID_API_URL``), and runs ``@publisher/name==x.y.z``.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        num_nodes: int,
        *,
        tls: bool = True,
        node_config: Callable[[int], Mapping[str, Any]] | None = None,
        app: str | os.PathLike[str] = APP,
        trusted_apps: bool = False,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.num_nodes = num_nodes
        self.tls = tls
        self.node_config = node_config or (lambda i: {})
        self.app = Path(app)
        self.trusted_apps = trusted_apps
        self.trust = self.workdir / "trust"
        self.registry: AppRegistry | None = None
        self.home = self.workdir / "flwr-home"
        self.certs = self.workdir / "certs"
        self.logs = self.workdir / "logs"
        self.port = free_port()
        self.node_ports = [free_port() for _ in range(num_nodes)]
        self.superlink: subprocess.Popen[bytes] | None = None
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.started: list[subprocess.Popen[bytes]] = []
        for d in (self.home, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    # -- environment ------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            "PATH": flower_path(),
        }

    def state_dir(self, i: int) -> Path:
        return self.workdir / "state" / f"node-{i}"

    def _spawn(self, args: list[str], log_name: str,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / log_name, "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen([flower_bin(args[0]), *args[1:]], env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.workdir, start_new_session=True)
        log.close()
        self.started.append(proc)
        return proc

    # -- processes --------------------------------------------------------------------
    def make_certificates(self) -> None:
        if not (self.certs / "server.pem").exists():
            subprocess.run(["bash", str(CERT_SCRIPT), str(self.certs), str(self.num_nodes)],
                           check=True, capture_output=True,
                           env={**os.environ, "PYTHON": sys.executable})

    def start_superlink(self, timeout: float = 60) -> None:
        args = ["flower-superlink", "--port", str(self.port),
                "--database", str(self.workdir / "superlink.db"),
                "--disable-runtime-dependency-installation"]
        if self.tls:
            args += ["--ssl-ca-certfile", str(self.certs / "ca.crt"),
                     "--ssl-certfile", str(self.certs / "server.pem"),
                     "--ssl-keyfile", str(self.certs / "server.key"),
                     "--enable-supernode-auth"]
        else:
            args += ["--insecure"]
        env = {}
        if self.registry is not None:  # the SuperLink's Flower Hub is the local registry
            env = {"FLWR_SUPERGRID_API_URL": self.registry.url,
                   "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self.superlink = self._spawn(args, "superlink.log", env)
        self._wait_for_port(self.port, timeout, self.superlink)

    def _wait_for_port(self, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}; see {self.logs}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"nothing listens on port {port} after {timeout} s; see {self.logs}")

    def write_connection(self) -> None:
        """The ``flwr`` CLI's connection to this SuperLink, in ``$FLWR_HOME/config.toml``."""
        lines = ["[superlink]", f'default = "{CONNECTION}"', "",
                 f"[superlink.{CONNECTION}]", f'address = "127.0.0.1:{self.port}"']
        lines.append(f'root-certificates = "{self.certs / "ca.crt"}"' if self.tls
                     else "insecure = true")
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([flower_bin("flwr"), *args], env=self.env, cwd=self.workdir,
                              capture_output=True, text=True, timeout=timeout)

    def register_nodes(self) -> None:
        for i in range(self.num_nodes):
            res = self.flwr("supernode", "register", str(self.certs / f"supernode-{i}.pub"),
                            CONNECTION)
            if res.returncode != 0 or "registered" not in res.stdout:
                raise RuntimeError(f"registering SuperNode {i} failed: {res.stdout}{res.stderr}")

    def full_node_config(self, i: int) -> dict[str, Any]:
        return {"partition-id": i, "num-partitions": self.num_nodes,
                "state-dir": str(self.state_dir(i)), **dict(self.node_config(i))}

    def start_node(self, i: int) -> None:
        args = ["flower-supernode", "--superlink", f"127.0.0.1:{self.port}",
                "--port", str(self.node_ports[i]),
                "--node-config", config_arg(self.full_node_config(i))]
        if self.tls:
            args += ["--root-certificates", str(self.certs / "ca.crt"),
                     "--auth-supernode-private-key", str(self.certs / f"supernode-{i}.key")]
        else:
            args += ["--insecure"]
        if self.trusted_apps:
            args += ["--trusted-entities", str(self.trust / TRUSTED_ENTITIES)]
        self.nodes[i] = self._spawn(args, f"supernode-{i}.log")

    def restart_node(self, i: int, timeout: float = 240, retry: float = 3.0) -> None:
        """Start SuperNode ``i`` again and keep restarting it, as a process supervisor
        would, until it is admitted.

        Why the retries: with SuperNode authentication the SuperLink refuses to activate a
        node id it still believes online; after a crash that lasts until the node has
        missed two heartbeats (about a minute), and ``flower-supernode`` exits meanwhile.
        """
        log = self.logs / f"supernode-{i}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = log.read_text(errors="replace").count("SuperNode ID:") if log.exists() else 0
            self.start_node(i)
            proc = self.nodes[i]
            while proc.poll() is None and time.monotonic() < deadline:
                if log.read_text(errors="replace").count("SuperNode ID:") > before:
                    return
                time.sleep(0.2)
            time.sleep(retry)
        raise TimeoutError(f"SuperNode {i} was not admitted again within {timeout} s")

    def kill(self, proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
        """Stop ``proc`` and everything it started (its session), as a crash would."""
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def kill_node(self, i: int) -> None:
        self.kill(self.nodes.pop(i, None))

    def kill_superlink(self) -> None:
        self.kill(self.superlink)
        self.superlink = None

    def setup_trusted_apps(self) -> None:
        """The publisher's key (``trust/publisher.key``, in real life on the publisher's
        machine), the SuperNodes' ``trust/trusted-entities.yaml`` naming its public key,
        and the app registry the SuperLink fetches signed FABs from."""
        if not (self.trust / f"{PUBLISHER}.key").exists():
            generate_publisher_key(self.trust)
            write_trusted_entities(self.trust / TRUSTED_ENTITIES,
                                   [self.trust / f"{PUBLISHER}.pub"])
        if self.registry is None:
            self.registry = AppRegistry(self.workdir / "registry").serve()

    def publish(self, app: str | os.PathLike[str] | None = None,
                key: str | os.PathLike[str] | None = None) -> str:
        """Build ``app``'s FAB (default: this deployment's app), sign it with ``key``
        (default: the trusted publisher key), publish it in the registry; return the app
        spec to ``flwr run``."""
        if self.registry is None:
            raise RuntimeError("publish needs trusted_apps=True and a started deployment")
        fab = build_fab(app or self.app)
        return self.registry.publish(fab, [sign_fab(fab, key or self.trust / f"{PUBLISHER}.key")])

    def start(self) -> LocalDeployment:
        if self.tls:
            self.make_certificates()
        if self.trusted_apps:
            self.setup_trusted_apps()
        self.start_superlink()
        self.write_connection()
        if self.tls:
            self.register_nodes()
        for i in range(self.num_nodes):
            self.start_node(i)
        return self

    def run_app(self, run_config: Mapping[str, Any], *, app: str | None = None,
                timeout: float = 600) -> subprocess.Popen[str]:
        """``flwr run`` of ``app`` (an app directory or ``@publisher/name==x.y.z``) on this
        deployment, streaming its log to a file. By default the deployment's app: with
        ``trusted_apps`` signed and published first, else uploaded from its directory."""
        if app is None:
            app = self.publish() if self.trusted_apps else str(self.app)
        args = [flower_bin("flwr"), "run", app, CONNECTION, "--stream",
                "--run-config", config_arg(run_config)]
        log = open(self.logs / "flwr-run.log", "a")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(args, env=self.env, cwd=self.workdir, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log.close()
        self.started.append(proc)  # type: ignore[arg-type]
        return proc

    def run_id(self) -> int | None:
        """The id of the last run ``flwr run`` started here (from ``logs/flwr-run.log``)."""
        log = self.logs / "flwr-run.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.findall(r"Successfully started run (\d+)", text)
        return int(found[-1]) if found else None

    def run_status(self, run_id: int) -> dict[str, Any]:
        """The SuperLink's record of run ``run_id`` (``flwr ls --run-id --format json``:
        ``status``, ``status-details``, …); ``{}`` if it cannot be read."""
        res = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            runs = json.loads(res.stdout).get("runs", [])
        except (ValueError, AttributeError):
            return {}
        return dict(runs[0]) if runs else {}

    def outcome(self, proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
        """``(exit code, what happened)`` of a ``flwr run`` that has exited: its own
        non-zero code, else 0 only if the SuperLink reports its run ``finished:completed``
        (waiting up to ``timeout`` s for the run to finish), else 1. Why: ``flwr run``
        exits 0 once its run ends whatever the run's status, so a ServerApp that raised
        would otherwise look like a success."""
        code = proc.wait()
        if code != 0:
            return int(code), f"flwr run exited with {code}"
        run_id = self.run_id()
        if run_id is None:
            return 1, f"flwr run started no run (see {self.logs / 'flwr-run.log'})"
        deadline = time.monotonic() + timeout
        while True:
            record = self.run_status(run_id)
            status = str(record.get("status", ""))
            if status.startswith("finished") or time.monotonic() > deadline:
                break
            time.sleep(1)
        if status == "finished:completed":
            return 0, f"run {run_id} {status}"
        details = " ".join(str(record.get("status-details", "")).split())
        return 1, f"run {run_id} {status or 'in an unknown state'}" + (
            f": {details}" if details else "")

    def close(self) -> None:
        """Stop every process this deployment started: SIGTERM to each one's session,
        newest first (the SuperLink last), then wait for them all together — a Flower
        process takes a second or two to shut down, so waiting for each in turn added
        seconds per process."""
        live = [p for p in reversed(self.started) if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(proc, signal.SIGKILL)
        if self.registry is not None:
            self.registry.close()
            self.registry = None

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (learners)")
    p.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True,
                   help="TLS and SuperNode authentication (default) or --no-tls (insecure)")
    p.add_argument("--trusted-apps", action=argparse.BooleanOptionalAction, default=None,
                   help="SuperNodes run only FABs signed by a trusted publisher key "
                        "(default: on with --tls)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=2)
    p.add_argument("--mechanism", default="blt")
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--dim", type=int, default=20)
    p.add_argument("--workdir", default=None, help="default: a new temporary directory")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flwr-corrnoise-deploy-"))
    horizon = args.rounds * args.local_steps
    learner = {"mechanism": args.mechanism, "epsilon": args.epsilon, "delta": args.delta,
               "horizon": horizon}
    run_config = {"num-learners": args.nodes, "dim": args.dim,
                  "num-server-rounds": args.rounds, "local-steps": args.local_steps,
                  "test-size": 500, "results-dir": str(workdir / "results"),
                  "checkpoint-dir": str(workdir / "checkpoint"), "mechanism": args.mechanism,
                  "epsilon": args.epsilon, "delta": args.delta}
    print(f"deployment in {workdir} ({'TLS' if args.tls else 'insecure'}, "
          f"{args.nodes} SuperNodes); logs in {workdir / 'logs'}", flush=True)
    trusted = args.tls if args.trusted_apps is None else args.trusted_apps
    with LocalDeployment(workdir, args.nodes, tls=args.tls, trusted_apps=trusted,
                         node_config=lambda i: learner) as dep:
        print(f"SuperLink on 127.0.0.1:{dep.port}; "
              f"FLWR_HOME={shlex.quote(str(dep.home))}", flush=True)
        run = dep.run_app(run_config)
        if trusted:
            print(f"SuperNodes trust only {dep.trust / TRUSTED_ENTITIES}; the app runs "
                  f"signed from the registry at {dep.registry.url if dep.registry else '?'}",
                  flush=True)
        log_path = dep.logs / "flwr-run.log"
        shown = 0
        while run.poll() is None:  # progress: follow the run's log
            time.sleep(1)
            text = log_path.read_text(errors="replace")
            for line in text[shown:].splitlines():
                if "[ROUND" in line or "flwr-corrnoise:" in line or "ERROR" in line:
                    print(line.strip(), flush=True)
            shown = len(text)
        code, what = dep.outcome(run)
        print(f"flwr-corrnoise: {what}; results in {workdir / 'results'}", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
