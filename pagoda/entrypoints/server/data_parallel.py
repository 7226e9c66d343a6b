"""`pagoda serve --data-parallel-size N`: N engine replicas on one host behind vllm-router and Pagoda's front.

Each replica is a plain `pagoda serve` child process on 127.0.0.1, bound to its own cores (sched_setaffinity)
with as many torch threads as it has cores. vllm-router (PyPI `vllm-router`, a Rust binary) sends each request
to one replica; its default policy here, cache_aware, sends requests that share a prefix to the replica that
has it cached. Clients never reach the router or the replicas: Pagoda's front (front.py) listens on
--host/--port, checks the user's API key and refuses the router's admin routes; the router listens on a free
loopback port with every route keyed (keyed_router.py). All three inner pieces accept only a secret this
process generates at start (the worker secret), handed over in their environment, so the user's key goes to
none of them and a local user who finds their ports can neither send requests nor add a worker of their own.

This process only supervises: it starts the replicas, waits until every one answers /health, starts the
router, then the front; a replica that dies is taken out of the router, restarted on the same port and cores,
and put back once healthy (at most RESTART_POLICY's restarts in its window, then it stays down); on
SIGTERM/Ctrl-C it stops them all: the replicas first (each drains its in-flight requests), then the router
and the front. The children die with it even when it is killed outright (PR_SET_PDEATHSIG).

Across machines the same pieces are started by hand: one `pagoda serve` per machine and vllm-router on one
of them (docs/deployment.md).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from pagoda.cpus import resolve as resolve_cpus
from pagoda.entrypoints.server.keyed_router import WORKER_SECRET_ENV

ROUTER_INSTALL_HINT = "pip install vllm-router (or: pip install -e '.[router]')"
# vllm-router's defaults keep sending requests to a dead worker until 10 of them failed (its circuit breaker)
# or three health checks a minute apart did; with 5 tries per request (its default), a threshold of 3 lets
# the first request after a crash still succeed on another worker. docs/deployment.md uses the same values.
ROUTER_FAILOVER_ARGS = ("--cb-failure-threshold", "3", "--health-check-interval-secs", "10",
                        "--health-failure-threshold", "2")
# Flags of `pagoda serve` that belong to this launcher, not to the replicas it starts. The user's --api-key
# is the front's alone: the replicas accept only the worker secret.
_LAUNCHER_DESTS = frozenset({"model", "model_flag", "host", "port", "data_parallel_size", "data_parallel_base_port",
                             "router_policy", "router_args", "api_key", "cpus", "threads", "batch_dir", "help"})
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2
_ROUTER_STOP_S = 3.0
# Resolved here, in the parent: between fork and exec a child should only call, not load.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True)
class RestartPolicy:
    """How often a replica that dies is started again: at most `max_restarts` times within `window_s` seconds,
    so a replica that cannot start (a bad flag, memory it cannot get) stops being retried."""
    max_restarts: int = 5
    window_s: float = 600.0

    def allows(self, restarts: list[float], now: float) -> bool:
        return sum(now - t < self.window_s for t in restarts) < self.max_restarts


RESTART_POLICY = RestartPolicy()


@dataclass
class Child:
    """A supervised process: a replica, the router or the front."""
    name: str
    cmd: list[str]
    url: str
    cores: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # over this process's, without its PAGODA_API_KEY
    token: str | None = None  # the bearer token its /health wants (the router's every route is keyed)
    proc: subprocess.Popen | None = None
    serving: bool = False  # a replica in the router's rotation
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart
    retry_at: float = 0.0  # a replica not yet back in the router: when to try again

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """`n` disjoint runs of consecutive cores (sizes differ by at most one), in the order given."""
    if not 1 <= n <= len(cores):
        raise ValueError(f"cannot split {len(cores)} cores among {n} replicas")
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), NUMA node by node: split into runs, N a multiple
    of the nodes keeps each replica on one node (Linux numbers the cores of a socket's hyperthreads apart)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    node = numa_node_of_core()
    return sorted(cores, key=lambda c: (node.get(c, 0), c))


def numa_node_of_core(root: Path = Path("/sys/devices/system/node")) -> dict[int, int]:
    """core -> NUMA node, from sysfs ({} where it cannot be read)."""
    out: dict[int, int] = {}
    for d in sorted(root.glob("node[0-9]*")):
        try:
            text = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            for c in range(int(lo), int(hi or lo) + 1):
                out[c] = int(d.name[4:])
    return out


def check_router_installed() -> None:
    """vllm-router's package must be importable by this interpreter: the keyed router runs it here."""
    if importlib.util.find_spec("vllm_router") is None:
        raise ValueError(f"--data-parallel-size needs vllm-router, which is not installed: {ROUTER_INSTALL_HINT}")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server can listen on it (SO_REUSEADDR as uvicorn binds: closed connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def replica_ports(base: int | None, front_port: int, n: int) -> list[int]:
    """BASE, BASE+1, ... (default BASE = the router's port + 1); BASE 0 = any free ports."""
    if base == 0:
        ports: list[int] = []
        while len(ports) < n:
            if (p := free_port()) not in ports and p != front_port:
                ports.append(p)
        return ports
    start = front_port + 1 if base is None else base
    ports = list(range(start, start + n))
    for rank, p in enumerate(ports):
        if p == front_port or not 0 < p < 65536 or not port_is_free(p):
            raise ValueError(f"port {p} for replica {rank} is not free; pass --data-parallel-base-port PORT "
                             "(or 0 for any free ports)")
    return ports


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The `pagoda serve` flags of `args` that the replicas take, as a command line: every flag whose value
    differs from its default, except the launcher's own (host, port, data-parallel and router flags)."""
    from pagoda.entrypoints.server.args import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    out = [args.model] if args.model else []
    for action in parser._actions:
        if action.dest in _LAUNCHER_DESTS or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        longs = [s for s in action.option_strings if s.startswith("--")] or action.option_strings
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(longs[0] if value else next(s for s in longs if s.startswith("--no-")))
        elif action.nargs == 0:  # store_true / store_false / store_const
            out.append(longs[0])
        elif isinstance(value, (list, tuple)):
            out += [longs[0], *map(_arg_text, value)]
        else:
            out += [longs[0], _arg_text(value)]
    return out


def _arg_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _say(msg: str) -> None:
    print(f"pagoda: data parallel: {msg}", file=sys.stderr, flush=True)


def _set_death_signal(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; a no-op elsewhere)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _child_setup(cores: list[int] | None, parent_pid: int, death_signal: int) -> Callable[[], None]:
    """What runs in the child between fork and exec: its cores, then the death signal, then a check that the
    parent did not die before the signal was armed."""
    def setup() -> None:
        if cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        _set_death_signal(death_signal)
        if os.getppid() != parent_pid:
            os._exit(1)
    return setup


def _health(url: str, token: str | None = None, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET /health, None when nothing answers."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, urllib.error.URLError):
        return None


def _healthy(url: str, token: str | None = None) -> bool:
    status = _health(url, token)
    return status is not None and 200 <= status < 300


class DataParallelServer:
    """Starts, watches and stops the replicas, the router and the front; restarts a replica that dies."""

    def __init__(self, replicas: list[Child], router: Child, front: Child, secret: str, drain_timeout: float,
                 restart: RestartPolicy = RESTART_POLICY) -> None:
        self.replicas = replicas
        self.router = router
        self.front = front
        self.secret = secret  # the worker secret: what the router and the replicas accept
        self.drain_timeout = drain_timeout
        self.restart = restart
        self.stop_signal: int | None = None  # set by the handler; reported outside it
        self._pumps: list[threading.Thread] = []

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self, on_ready: Callable[[], None]) -> int:
        """Start everything, serve until a signal (exit code 0) or until the router or every replica is gone (1)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for r in self.replicas:
                self._start(r, signal.SIGTERM)  # a replica drains its requests on SIGTERM
            if not self._wait_healthy(self.replicas):
                return 0 if self.stop_requested else 1
            for r in self.replicas:
                r.serving = True  # the router starts with every one of them
            # The router and the front hold nothing worth a grace period.
            self._start(self.router, signal.SIGKILL)
            if not self._wait_healthy([self.router]):
                return 0 if self.stop_requested else 1
            self._start(self.front, signal.SIGKILL)
            if not self._wait_healthy([self.front]):
                return 0 if self.stop_requested else 1
            on_ready()
            return self._watch()
        finally:
            if self.stop_signal is not None:
                _say(f"{signal.Signals(self.stop_signal).name}: stopping the replicas, then the router and the front")
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:  # no printing here: the main thread may be inside a write to stderr
            self.stop_signal = signum

    def _start(self, child: Child, death_signal: int) -> None:
        # The user's key, which the launcher may have read from PAGODA_API_KEY, reaches only the child that is
        # given it (the front).
        inherited = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **child.env}
        # A session of its own: the terminal's Ctrl-C reaches this process only, which stops the children in order.
        child.proc = subprocess.Popen(child.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_child_setup(child.cores, os.getpid(), death_signal))
        cores = f", cores {','.join(map(str, child.cores))}" if child.cores is not None else ""
        _say(f"{child.name} started (pid {child.proc.pid}{cores}) on {child.url}")
        assert child.proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(child.proc.stdout, f"[{child.name}] ", sys.stderr),
                                name=f"pagoda-{child.name}-log", daemon=True)
        pump.start()
        self._pumps.append(pump)

    def _wait_healthy(self, children: list[Child]) -> bool:
        """Until each child answers /health; False if one exits first or a signal asks to stop."""
        pending = list(children)
        while pending:
            if self.stop_requested:
                return False
            for c in list(pending):
                if not c.alive:
                    _say(f"error: {c.name} exited with code {c.proc and c.proc.returncode} before it was ready")
                    return False
                status = _health(c.url, c.token)
                if status == 401:  # the router caches a refused token for good: it will never accept ours
                    _say(f"error: {c.name} refused the worker secret")
                    return False
                if status is not None and 200 <= status < 300:
                    pending.remove(c)
            time.sleep(_POLL_S)
        return True

    def _watch(self) -> int:
        while not self.stop_requested:
            for r in self.replicas:
                if r.proc is None:
                    continue  # given up on
                if not r.alive:
                    self._replica_exited(r)
                elif not r.serving and time.monotonic() >= r.retry_at and _healthy(r.url):
                    self._rejoin(r)
            if all(r.proc is None for r in self.replicas):
                _say("error: every replica has exited")
                return 1
            for c in (self.router, self.front):
                if not c.alive:
                    _say(f"error: the {c.name} exited with code {c.proc and c.proc.returncode}")
                    return 1
            time.sleep(_POLL_S)
        return 0

    def _replica_exited(self, r: Child) -> None:
        """Out of the router at once (not after its health checks), then started again if the policy allows."""
        assert r.proc is not None
        _say(f"error: {r.name} exited with code {r.proc.returncode}; the router stops sending it requests")
        if r.serving:
            r.serving = False
            if (err := self._router_admin("remove_worker", r.url)) is not None:
                _say(f"could not remove {r.name} from the router: {err}")
        now = time.monotonic()
        if self.stop_requested or not self.restart.allows(r.restarts, now):
            if not self.stop_requested:
                _say(f"error: {r.name} exited {self.restart.max_restarts + 1} times within "
                     f"{self.restart.window_s:.0f} s; it stays down")
            r.proc = None
            return
        r.restarts = [t for t in r.restarts if now - t < self.restart.window_s] + [now]
        _say(f"restarting {r.name} ({len(r.restarts)} of {self.restart.max_restarts} restarts within "
             f"{self.restart.window_s:.0f} s)")
        self._start(r, signal.SIGTERM)

    def _rejoin(self, r: Child) -> None:
        """A restarted replica that answers /health goes back into the router's rotation."""
        err = self._router_admin("add_worker", r.url)
        if err is None or "already exists" in err:
            r.serving = True
            _say(f"{r.name} is healthy again and back in the router")
        else:
            r.retry_at = time.monotonic() + 5.0
            _say(f"could not add {r.name} back to the router: {err}")

    def _router_admin(self, action: str, worker_url: str) -> str | None:
        """vllm-router's POST /add_worker or /remove_worker, keyed by the worker secret; None or the error."""
        url = f"{self.router.url}/{action}?url={urllib.parse.quote(worker_url, safe='')}"
        request = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {self.secret}"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}: {e.read(500).decode('utf-8', 'replace')}"
        except (OSError, urllib.error.URLError) as e:
            return str(e)
        return None

    def stop(self) -> None:
        """SIGTERM the replicas and wait for them to drain (then SIGKILL), then stop the router and the front.
        Idempotent."""
        _terminate([r for r in self.replicas if r.alive], self.drain_timeout + 10.0, signal.SIGTERM)
        # vllm-router's graceful shutdown can wait on idle client connections: it gets a few seconds, then SIGKILL.
        _terminate([c for c in (self.router, self.front) if c.alive], _ROUTER_STOP_S, signal.SIGTERM)
        for pump in self._pumps:
            pump.join(timeout=1.0)


def _terminate(children: list[Child], grace_s: float, sig: int) -> None:
    for c in children:
        assert c.proc is not None
        c.proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for c in children:
        assert c.proc is not None
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(f"{c.name} did not stop in {grace_s:.0f} s; killing it")
            c.proc.kill()
            c.proc.wait()


def _pump(stream: IO[bytes], prefix: str, out: IO[str]) -> None:
    """Copy a child's output to ours, each line tagged with the child's name."""
    for raw in iter(stream.readline, b""):
        out.write(prefix + raw.decode("utf-8", "replace"))
        out.flush()
    stream.close()


def build(args: argparse.Namespace) -> tuple[DataParallelServer, str]:
    """Check the flags and plan the children (nothing starts); returns the server and its public URL."""
    n = args.data_parallel_size
    if n < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    tp = getattr(args, "tensor_parallel_size", None) or 1
    cores = usable_cores()
    if getattr(args, "cpus", None) is not None:  # the launcher's pool to split between the replicas, not each replica's
        chosen = set(resolve_cpus(args.cpus, None)[0] or ())
        cores = [c for c in cores if c in chosen]
    if n * tp > len(cores):
        what = f"{n} replicas" + (f" x {tp} tensor-parallel ranks" if tp > 1 else "")
        raise ValueError(f"--data-parallel-size {n}: {what} need {n * tp} cores, and this process may use "
                         f"{len(cores)} ({','.join(map(str, cores))})")
    router_extra = shlex.split(args.router_args or "")
    check_router_installed()
    ports = replica_ports(args.data_parallel_base_port, args.port, n)
    router_port = free_port()
    while router_port in ports or router_port == args.port:
        router_port = free_port()
    from pagoda.config import server_api_key

    user_key = server_api_key(args.api_key)
    secret = secrets.token_urlsafe(32)
    common = forwarded_args(args)
    replicas = []
    for rank, (port, group) in enumerate(zip(ports, split_cores(cores, n))):
        # Files and batch jobs live on one server's disk, which the router cannot route to: off in replicas.
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *common, "--host", "127.0.0.1",
               "--port", str(port), "--batch-dir", "none"]
        threads = str(len(group))
        replicas.append(Child(f"replica {rank}", cmd, f"http://127.0.0.1:{port}", group,
                              {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PAGODA_API_KEY": secret}))
    router_cmd = [sys.executable, "-m", "pagoda.entrypoints.server.keyed_router",
                  "--worker-urls", *(r.url for r in replicas), "--host", "127.0.0.1", "--port", str(router_port),
                  "--policy", args.router_policy,
                  # The replicas are healthy before the router starts: check at once, not after its 30 s default.
                  "--worker-startup-check-interval", "1", *ROUTER_FAILOVER_ARGS, "--log-level", args.log_level]
    if "--prometheus-port" not in router_extra:  # its default, 29000, would collide between two launchers
        router_cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    router = Child("router", router_cmd + router_extra, f"http://127.0.0.1:{router_port}",
                   env={WORKER_SECRET_ENV: secret}, token=secret)
    front_cmd = [sys.executable, "-m", "pagoda.entrypoints.server.front", "--host", args.host, "--port",
                 str(args.port), "--router", router.url, "--replica", *(r.url for r in replicas),
                 "--log-level", args.log_level, "--header-timeout", str(args.header_timeout),
                 *(["--max-connections", str(args.max_connections)] if args.max_connections else [])]
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    front = Child("front", front_cmd, f"http://{host}:{args.port}",
                  env={WORKER_SECRET_ENV: secret, **({"PAGODA_API_KEY": user_key} if user_key else {})})
    server = DataParallelServer(replicas, router, front, secret, args.drain_timeout)
    return server, f"http://{args.host}:{args.port}"


def main(args: argparse.Namespace, model_name: str) -> int:
    """Run `pagoda serve --data-parallel-size N` until SIGTERM/Ctrl-C; the exit code says how it ended."""
    server, url = build(args)

    def ready() -> None:
        print(f"pagoda: serving {model_name} on {url}: {len(server.replicas)} replicas behind vllm-router "
              f"(policy {args.router_policy}, {server.router.url}) and Pagoda's front: "
              f"{', '.join(r.url for r in server.replicas)}", file=sys.stderr, flush=True)

    return server.run(ready)
