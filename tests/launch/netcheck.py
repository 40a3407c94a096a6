"""Watch which addresses a process tree talks to, from /proc (Linux), for the loopback-only tests.

``NetWatch(root_pid)`` samples, on a background thread, every TCP and UDP socket held by ``root_pid`` and
its descendants (the embedded Ray cluster's GCS, raylets, agents and workers are all descendants of the
driver) and records every connected peer address that is not loopback. ``LoopbackAudit`` does the same
inside this Python process through the ``socket.connect`` audit event, which also sees short-lived
sockets a sampler could miss.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

_PROC_NET = ("tcp", "tcp6", "udp", "udp6")


def session_processes(pid: int) -> list[str]:
    """Command lines of live processes of the Ray session a driver with ``pid`` started."""
    out = subprocess.run(["pgrep", "-af", f"session_[0-9_-]*_{pid}( |/|$)"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def socket_inodes(pids: set[int]) -> dict[str, int]:
    """Socket inode -> the pid holding it."""
    inodes = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    return inodes


def _decode(hex_addr: str) -> str:
    host, _port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc/net prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified


def peers(inodes) -> list[tuple[str, str, str]]:
    """(protocol, remote host, inode) of every connected socket among ``inodes``."""
    found = []
    for proto in _PROC_NET:
        try:
            with open(f"/proc/net/{proto}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes and fields[2].split(":")[1] != "0000":  # port 0: not connected
                found.append((proto, _decode(fields[2]), fields[9]))
    return found


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (to tell it from a later one with the same pid); None once it is gone or
    a zombie (exited, only waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return f"pid {pid}"


class NetWatch:
    """Samples the sockets of ``root_pid``'s process tree every ``interval_s`` until ``stop()``."""

    def __init__(self, root_pid: int, interval_s: float = 0.5):
        self.root_pid, self.interval_s = root_pid, interval_s
        self.violations: set[tuple[str, str]] = set()  # (protocol, remote host)
        self.culprits: set[str] = set()  # command lines of the processes that held them
        self.samples = 0
        self.connected_seen = 0
        self.seen: dict[int, Optional[str]] = {}  # every descendant process seen: pid -> its start time
        self._before: set[int] = set()  # descendants already running when the watch started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "NetWatch":
        # Processes already below the root (e.g. the multiprocessing resource tracker an earlier test's
        # spawned ranks started for pytest) are not this test's, so they are not survivors of it.
        self._before = descendants(self.root_pid) - {self.root_pid}
        self._thread.start()
        return self

    def sample(self) -> None:
        pids = descendants(self.root_pid)
        for pid in pids - {self.root_pid} - self._before:
            self.seen.setdefault(pid, _start_time(pid))
        inodes = socket_inodes(pids)
        found = peers(inodes)
        self.samples += 1
        self.connected_seen += len(found)
        for proto, host, inode in found:
            if not is_loopback(host):
                self.violations.add((proto, host))
                self.culprits.add(_cmdline(inodes[inode]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> "NetWatch":
        self._stop.set()
        self._thread.join()
        return self

    def survivors(self) -> list[str]:
        """Command lines of processes seen below the root that still run (the same process, not a reused pid)."""
        return [_cmdline(pid) for pid, started in self.seen.items()
                if started is not None and _start_time(pid) == started]

    def wait_survivors(self, timeout_s: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.survivors()


class LoopbackAudit:
    """Records every ``socket.connect`` of this process to a non-loopback address while ``active``."""

    _installed: "LoopbackAudit | None" = None

    def __init__(self):
        self.active = False
        self.violations: list = []
        self.connects = 0

    @classmethod
    def install(cls) -> "LoopbackAudit":
        # Audit hooks cannot be removed, so one instance serves the whole session.
        if cls._installed is None:
            cls._installed = cls()
            sys.addaudithook(cls._installed._hook)
        return cls._installed

    def _hook(self, event: str, args) -> None:
        if event != "socket.connect" or not self.active:
            return
        sock, address = args
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            self.connects += 1
            if not is_loopback(str(address[0])):
                self.violations.append(address)


STRACE_CALLS = "trace=connect,sendto,sendmsg,sendmmsg"  # every way a socket can address a peer
_STRACE_ADDR = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')
_STRACE_CALL = re.compile(r"^\d+\s+(connect|sendto|sendmsg|sendmmsg)\(")


def strace_peers(log_path: str) -> set[str]:
    """Every non-loopback peer address in an ``strace -f -e {STRACE_CALLS}`` log: catches sockets too
    short-lived for ``NetWatch`` (a DNS query lasts milliseconds)."""
    bad = set()
    with open(log_path) as f:
        for line in f:
            if not _STRACE_CALL.match(line):
                continue
            for v4, v6 in _STRACE_ADDR.findall(line):
                host = v4 or v6
                if not is_loopback(host):
                    bad.add(host)
    return bad
