"""What a node run may change on the machine, read before `up` and after `down`.

Each part is read from the kernel or the tools, not from hack/node.sh's own notes, so a
`down` that forgets something shows here. Other work on a shared machine (podman's CNI
network, kvferry_dev/netns.py's namespaces on 10.213.0.0/24) can change routes, rules and
mounts meanwhile; the lines that belong to it are left out by name.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path

# Other tenants of the machine: podman's CNI bridge and rules, netns.py's namespaces and
# veths (kvferry-p-r, ...; this tier's own names are kvfnode0 and kvferry-node-N).
FOREIGN = re.compile(
    r"cni-podman|CNI-|10\.88\.|10\.213\.|/run/netns|/var/lib/containers|/run/containers"
    r"|kvferry-(?!node)"
)
# The kernel's tunables the kubelet, kube-proxy and CNI are known to write, and the
# families around them (so a new one shows up too). Per-interface keys only for
# interfaces that outlive a run.
SYSCTLS = re.compile(
    r"^(vm\.|kernel\.panic|kernel\.keys\.|net\.ipv4\.(ip_|conf\.(all|default|lo|eth0)\.)"
    r"|net\.ipv6\.conf\.(all|default|lo)\.|net\.bridge\.|net\.netfilter\.nf_conntrack_(max|tcp_timeout)"
    r"|net\.nf_conntrack_max|net\.core\.)"
)
# Counters and clocks that move on their own.
VOLATILE = re.compile(r"^(vm\.(stat_|nr_|dirty)|net\.core\.(netdev_rss_key|bpf_))")
COUNTERS = re.compile(r" \[\d+:\d+\]$")
HOST_PATHS = ("/var/lib/kubelet", "/run/containerd", "/opt/containerd")


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout


def _podman_veths() -> frozenset[str]:
    """The veths on podman's bridge: its containers come and go with other work."""
    return frozenset(
        line.split(":")[1].strip().split("@")[0]
        for line in _run("ip", "-o", "link").splitlines()
        if "master cni-podman" in line
    )


def _keep(lines: str, foreign_devs: frozenset[str] = frozenset()) -> tuple[str, ...]:
    return tuple(
        sorted(
            line
            for line in lines.splitlines()
            if line and not FOREIGN.search(line) and not foreign_devs & set(line.split())
        )
    )


@dataclass(frozen=True)
class Machine:
    sysctls: tuple[str, ...]
    iptables: tuple[str, ...]
    routes: tuple[str, ...]
    links: tuple[str, ...]
    mounts: tuple[str, ...]
    cgroups: tuple[str, ...]
    paths: tuple[str, ...]

    def differences(self, after: Machine) -> dict[str, tuple[list[str], list[str]]]:
        """{part: (lines gone, lines new)} for every part that changed."""
        out = {}
        for f in fields(self):
            old, new = set(getattr(self, f.name)), set(getattr(after, f.name))
            if old != new:
                out[f.name] = (sorted(old - new), sorted(new - old))
        return out


def _iptables() -> str:
    lines = []
    for tool in ("iptables-save", "ip6tables-save"):
        for line in _run(tool).splitlines():
            if line.startswith("#"):
                continue
            # chain counters ":NAME POLICY [p:b]" move with traffic
            lines.append(tool + " " + COUNTERS.sub("", line))
    return "\n".join(lines)


def _cgroups() -> str:
    root = Path("/sys/fs/cgroup")
    return "\n".join(
        str(p)
        for h in root.iterdir()
        if h.is_dir()
        for p in h.iterdir()
        if p.is_dir() and p.name.startswith(("kvferry-node", "kubepods"))
    )


def snapshot() -> Machine:
    sysctls = "\n".join(
        line
        for line in _run("sysctl", "-a").splitlines()
        if SYSCTLS.match(line) and not VOLATILE.match(line)
    )
    links = "\n".join(
        line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link").splitlines()
    )
    podman = _podman_veths()
    mounts = "\n".join(line.split()[4] for line in _run("cat", "/proc/self/mountinfo").splitlines())
    return Machine(
        sysctls=_keep(sysctls),
        iptables=_keep(_iptables()),
        routes=_keep(
            _run("ip", "route", "show", "table", "all")
            + _run("ip", "-6", "route", "show", "table", "all"),
            podman,
        ),
        links=_keep(links, podman),
        mounts=_keep(mounts),
        cgroups=_keep(_cgroups()),
        paths=tuple(p for p in HOST_PATHS if Path(p).exists()),
    )
