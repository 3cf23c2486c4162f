"""Two network hosts on one machine: network namespaces joined by a veth pair, one torchrun agent in each.

With ``wire=Wire(...)`` the namespaces are joined instead by two TAP devices and a user-space wire
(``wire.py``) that delays and drops frames like ``tc netem`` would (this machine's kernel has no netem).

Host ``i`` is a network namespace holding one end of a veth pair with address ``10.77.0.{i+1}/24``, its
loopback up, a UTS namespace of its own per launched command (hostname ``node{i}``) and an ``/etc/hosts``
(``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``) naming both nodes. Nothing in a namespace can
reach any other address. Every process the tests start runs inside a namespace, so ``ip netns pids``
finds all of them (torchrun's workers included, which leave the agent's process group) and
:meth:`TwoHosts.close` kills them by pid before deleting the namespaces (which deletes the veth).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ds_ring.testing import Progress

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare")
SUBNET = "10.77.0"
RDZV_PORT = 29400
IFACE = "hostlink"
"""The name of the link's end inside each host (the same on both, like ``eth0`` on every node of a cluster)."""
_pairs = itertools.count()


def unavailable() -> str | None:
    """Why two hosts cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth pairs)"
    if not os.path.exists(IP):
        return "iproute2's `ip` is not installed"
    if UNSHARE is None:
        return "`unshare` (util-linux) is not installed"
    probe = f"dsrprobe{os.getpid()}"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Wire:
    """A slow, lossy link: each frame delayed ``delay_ms ± jitter_ms`` (uniform) and dropped with probability
    ``loss``. Its MTU is 65000 bytes, like the 64 KiB GSO packets netem delays and drops on a veth."""

    delay_ms: float = 20.0
    jitter_ms: float = 5.0
    loss: float = 0.01
    mtu: int = 65000


@dataclass
class HostRun:
    """One agent: its process and log."""

    proc: subprocess.Popen
    log: Path
    handle: object


@dataclass
class TwoHosts:
    """Two namespaces ``ns[0]``, ``ns[1]`` joined by veth ``veth[0]`` <-> ``veth[1]`` (each renamed :data:`IFACE`
    inside its namespace), hosts ``node0``, ``node1``."""

    tag: str = field(default_factory=lambda: f"dsr{os.getpid() % 100000}{next(_pairs)}")
    wire: Wire | None = None
    runs: list[HostRun] = field(default_factory=list)
    _wire_proc: subprocess.Popen | None = None

    @property
    def ns(self) -> tuple[str, str]:
        return f"{self.tag}a", f"{self.tag}b"

    @property
    def veth(self) -> tuple[str, str]:
        return f"{self.tag}va", f"{self.tag}vb"

    hostnames = ("node0", "node1")

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def open(self) -> TwoHosts:
        for ns in self.ns:
            _ip("netns", "add", ns)
            hosts = Path("/etc/netns") / ns / "hosts"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            names = "".join(f"{self.address(i)} {name}\n" for i, name in enumerate(self.hostnames))
            hosts.write_text(f"127.0.0.1 localhost\n{names}")
        if self.wire is None:
            _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        else:
            self._start_wire(self.wire)
        for i, (ns, veth) in enumerate(zip(self.ns, self.veth, strict=True)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "link", "set", veth, "name", IFACE)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
            if self.wire is not None:
                _ip("-n", ns, "link", "set", IFACE, "mtu", str(self.wire.mtu))
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _start_wire(self, wire: Wire) -> None:
        script = Path(__file__).with_name("wire.py")
        self._wire_proc = subprocess.Popen(
            [sys.executable, str(script), *self.veth, "--delay-ms", str(wire.delay_ms), "--jitter-ms",
             str(wire.jitter_ms), "--loss", str(wire.loss)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        ready = self._wire_proc.stdout.readline() if self._wire_proc.stdout else ""
        if ready.strip() != "ready":
            raise RuntimeError(f"the user-space wire did not start: {ready}{self._wire_proc.stdout.read()}")

    def close(self) -> None:
        """Kill every process in both namespaces, then delete them (and the veth); never raises."""
        self.kill_all()
        if self._wire_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._wire_proc.pid, signal.SIGKILL)
            self._wire_proc.wait()
            self._wire_proc = None
        for ns in self.ns:
            subprocess.run([IP, "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    # Processes ---------------------------------------------------------------------------------------

    def command(self, host: int, argv: list[str], **env: str) -> list[str]:
        """``argv`` run on ``host``: inside its namespace, with its hostname and ``GLOO_SOCKET_IFNAME``."""
        variables = {"GLOO_SOCKET_IFNAME": IFACE, "PYTHONUNBUFFERED": "1", **env}
        inner = ["env", *(f"{k}={v}" for k, v in variables.items()), *argv]
        set_name = 'hostname "$0" && exec "$@"'
        return [IP, "netns", "exec", self.ns[host], UNSHARE, "--uts", "sh", "-c", set_name, self.hostnames[host],
                *inner]  # fmt: skip

    def torchrun(self, script: list[str], logs: Path, *, nproc: int = 2, max_restarts: int = 0, **env: str) -> None:
        """Start one ``torchrun --nnodes 2`` agent per host (c10d rendezvous on host 0); logs ``logs/node{i}.log``."""
        self.runs = []
        run_id = f"{self.tag}-{time.monotonic_ns()}"
        for host in (0, 1):
            argv = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(host),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address(0)}:{RDZV_PORT}", "--rdzv-id", run_id,
                    "--max-restarts", str(max_restarts), *script]  # fmt: skip
            log = logs / f"node{host}.log"
            handle = open(log, "w")  # noqa: SIM115 - closed in wait()
            proc = subprocess.Popen(self.command(host, argv, **env), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            self.runs.append(HostRun(proc, log, handle))

    def mpirun(self, script: list[str], logs: Path, **env: str) -> None:
        """Start ``mpirun -np 4`` (2 slots per host) of ``python script`` on host 0; it starts host 1's ranks
        through an ``ssh`` stand-in (``plm_rsh_agent``) that enters host 1's namespace. Logs ``logs/node0.log``."""
        agent = logs / "agent.sh"
        cases = " ".join(f"{name}) ns={ns};;" for name, ns in zip(self.hostnames, self.ns, strict=True))
        agent.write_text(f"""#!/bin/sh
# ssh HOST COMMAND, for hosts that are network namespaces of this machine
host=$1; shift
case $host in {cases} *) echo "unknown host $host" >&2; exit 1;; esac
exec {IP} netns exec $ns {UNSHARE} --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
        agent.chmod(0o755)
        hostfile = logs / "hostfile"
        hostfile.write_text("".join(f"{name} slots=2\n" for name in self.hostnames))
        variables = {"GLOO_SOCKET_IFNAME": IFACE, "MASTER_ADDR": self.hostnames[0], "MASTER_PORT": str(RDZV_PORT),
                     "PYTHONUNBUFFERED": "1", **env}  # fmt: skip
        exported = [arg for key in ("PATH", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "PYTHONPATH") if key in os.environ
                    for arg in ("-x", key)]  # fmt: skip
        argv = ["mpirun", "--allow-run-as-root", "-np", "4", "--hostfile", str(hostfile), "--bind-to", "none",
                "--display-map", "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "self,tcp",
                "--mca", "btl_tcp_if_include", IFACE, "--mca", "oob_tcp_if_include", IFACE, *exported,
                *(arg for key, value in variables.items() for arg in ("-x", f"{key}={value}")),
                sys.executable, *script]  # fmt: skip
        log = logs / "node0.log"
        handle = open(log, "w")  # noqa: SIM115 - closed in wait()
        proc = subprocess.Popen(self.command(0, argv), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        self.runs = [HostRun(proc, log, handle)]

    def wait(self, timeout: float, poll: Callable[[], object] | None = None) -> list[int | None]:
        """Exit codes of both agents (``None``: still running when their processes had used no CPU for ``timeout``
        seconds, then killed: :class:`ds_ring.testing.Progress`), calling ``poll()`` every 50 ms meanwhile; kills
        every process left in either namespace."""
        progress = Progress(lambda: [run.proc.pid for run in self.runs if run.proc.poll() is None], timeout)
        try:
            while not progress.stalled() and any(run.proc.poll() is None for run in self.runs):
                if poll is not None:
                    poll()
                time.sleep(0.05)
            return [run.proc.poll() for run in self.runs]
        finally:
            self.kill_all()
            for run in self.runs:
                run.handle.close()

    def output(self, host: int) -> str:
        return self.runs[host].log.read_text(errors="replace")

    def pids(self, host: int) -> list[int]:
        listed = subprocess.run([IP, "netns", "pids", self.ns[host]], capture_output=True, text=True).stdout
        return [int(pid) for pid in listed.split() if int(pid) != os.getpid()]

    def kill_host(self, host: int) -> None:
        """SIGKILL every process on ``host`` (the node dies)."""
        for _ in range(3):  # a process may fork while the others are being killed
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for run in self.runs:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                if run.proc.poll() is None and not self.pids(self.runs.index(run)):
                    run.proc.wait(1)

    def kill_all(self) -> None:
        for host in (0, 1):
            self.kill_host(host)
        for run in self.runs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.proc.wait(5)

    # The link ----------------------------------------------------------------------------------------

    def link(self, up: bool) -> None:
        """Set host 0's end of the veth up or down (down: nothing passes either way)."""
        _ip("-n", self.ns[0], "link", "set", IFACE, "up" if up else "down")

    def bytes_sent(self, host: int | None = None) -> int:
        """Bytes ``host`` (``None``: both) has sent over the link since it was made."""
        if host is None:
            return self.bytes_sent(0) + self.bytes_sent(1)
        shown = _run([IP, "-n", self.ns[host], "-j", "-s", "link", "show", "dev", IFACE])
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])


def _ip(*args: str) -> None:
    _run([IP, *args])


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout
