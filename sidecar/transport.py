"""What the P<->D KV path uses, as far as a sidecar can tell. Pure, except
:func:`read_rdma_devices` (sysfs).

vLLM 0.32 and NIXL 1.5 do not expose the UCX transport they negotiated: the
connector's metrics are byte counts and durations (``vllm:nixl_*``), and only
UCX's own debug output (``UCX_PROTO_INFO=y`` / ``UCX_LOG_LEVEL``, in the engine's
log) names the lanes. So the sidecar reports from what it can observe:

1. what was asked: ``network.transport`` (auto | rdma | tcp) and
   ``network.rdma.enabled``, from the settings file the operator renders;
2. what the engine runs with: ``UCX_TLS`` and ``UCX_NET_DEVICES`` of the engine
   container, which the operator copies into the sidecar's environment
   (``KVFERRY_ENGINE_UCX_TLS``, ``KVFERRY_ENGINE_UCX_NET_DEVICES``);
3. what the pod has: RDMA devices under ``/sys/class/infiniband`` and whether any
   port is ACTIVE. sysfs shows the devices of the pod's network namespace, which
   every container of the pod shares (``/dev/infiniband`` does not: the device
   plugin gives it to the engine container alone);
4. what was measured: NIXL bytes / NIXL transfer seconds of the local engine
   (the report's ``transfer``; the operator divides them into GB/s).

Rules (:func:`classify`):

- RDMA: an RDMA device has an ACTIVE port, ``UCX_TLS`` allows an RDMA transport
  and ``UCX_NET_DEVICES`` (when set) names one of the devices. UCX ranks RDMA
  lanes above TCP when both are allowed; a UCX build without verbs support
  would still pick TCP, which cannot be seen from here (the reason says so).
  In the RDMA shared device plugin's mode every pod sees all of the node's HCAs in
  sysfs, usable or not: the verdict is then what the pod could use, and only
  measured pulls confirm it (the operator turns a server whose every pull fails
  into NoTransport, whatever the sidecars see).
- TCP / TCPFallback: RDMA is impossible by the above and ``UCX_TLS`` allows
  ``tcp``. ``TCP`` when RDMA was not asked for (``network.transport`` tcp, or auto
  on a cluster without usable RDMA: what was asked is what runs); ``TCPFallback``
  only when it was (``network.transport: rdma`` or ``network.rdma.enabled``): the
  operator warns.
- NoTransport: ``UCX_TLS`` allows neither a usable RDMA transport nor ``tcp``: transfers
  between pods fail outright (the operator warns).
- Unknown: sysfs cannot be read while RDMA would be allowed.

Shared memory (``sm``, ``cma``) is ignored: prefill and decode run in different
pods, which share no memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvferry_wire.report import (
    TRANSPORT_NONE,
    TRANSPORT_RDMA,
    TRANSPORT_TCP,
    TRANSPORT_TCP_FALLBACK,
    TRANSPORT_UNKNOWN,
)

# UCX_TLS names of RDMA transports (aliases and concrete ones; srd = AWS EFA).
RDMA_TLS = frozenset(
    {
        "ib",
        "rc",
        "rc_v",
        "rc_x",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "ud",
        "ud_v",
        "ud_x",
        "ud_verbs",
        "ud_mlx5",
        "srd",
    }
)
TCP_TL = "tcp"
PORT_ACTIVE = "ACTIVE"
SYSFS_INFINIBAND = "/sys/class/infiniband"


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    active_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Evidence:
    requested: str = "auto"  # network.transport
    rdma_enabled: bool = False  # network.rdma.enabled
    ucx_tls: str | None = None  # the engine's UCX_TLS; None = unset (UCX picks)
    ucx_net_devices: str | None = None  # the engine's UCX_NET_DEVICES; None = unset
    # RDMA devices of the pod; None = sysfs could not be read.
    rdma_devices: tuple[RdmaDevice, ...] | None = ()

    @property
    def rdma_asked(self) -> bool:
        return self.requested == "rdma" or self.rdma_enabled


@dataclass(frozen=True)
class Verdict:
    transport: str
    reason: str


def _names(value: str | None) -> list[str] | None:
    """A UCX list setting as names (``:aux`` / ``:1`` suffixes kept); None = all."""
    if value is None or value.strip().lower() in ("", "all"):
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def tls_allows(ucx_tls: str | None, wanted: frozenset[str]) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX use any transport in ``wanted``.
    A leading ``^`` makes the list an exclusion list (UCX's syntax)."""
    names = _names(ucx_tls)
    if names is None:
        return True
    exclude = names[0].startswith("^")
    if exclude:
        names[0] = names[0][1:]
    base = {n.split(":", 1)[0].lower() for n in names}
    return not wanted <= base if exclude else bool(base & wanted)


def _configured(ev: Evidence) -> str:
    tls = ev.ucx_tls if ev.ucx_tls is not None else "unset"
    out = f"UCX_TLS={tls}"
    if ev.ucx_net_devices is not None:
        out += f", UCX_NET_DEVICES={ev.ucx_net_devices}"
    return out


def classify(ev: Evidence) -> Verdict:
    """The transport and one line of evidence (see the module docstring).

    The reason names configuration and devices only, so it stays the same while
    traffic flows (the operator copies it into status); the measured bandwidth
    travels as the report's NIXL bytes and seconds."""
    rdma_tls = tls_allows(ev.ucx_tls, RDMA_TLS)
    tcp_tls = tls_allows(ev.ucx_tls, frozenset({TCP_TL}))
    configured = _configured(ev)
    devices = ev.rdma_devices
    why_not_rdma: str | None = None
    if not rdma_tls:
        why_not_rdma = "UCX_TLS allows no RDMA transport"
    elif devices is None:
        why_not_rdma = None  # cannot tell
    else:
        active = [d for d in devices if d.active_ports]
        wanted = _names(ev.ucx_net_devices)
        if wanted is not None:
            names = {w.split(":", 1)[0] for w in wanted}
            active = [d for d in active if d.name in names]
        if not devices:
            why_not_rdma = f"no RDMA device in the pod ({SYSFS_INFINIBAND} is empty)"
        elif not any(d.active_ports for d in devices):
            names_all = ", ".join(d.name for d in devices)
            why_not_rdma = f"RDMA device(s) {names_all} have no ACTIVE port"
        elif not active:
            why_not_rdma = "UCX_NET_DEVICES names no active RDMA device"
        else:
            names_active = ", ".join(d.name for d in active)
            return Verdict(
                TRANSPORT_RDMA,
                f"RDMA device(s) {names_active} active and {configured} allows RDMA "
                "(UCX ranks RDMA above TCP; a UCX build without verbs would not show here)",
            )
    if why_not_rdma is None:
        return Verdict(
            TRANSPORT_UNKNOWN,
            f"cannot read {SYSFS_INFINIBAND} to see RDMA devices; {configured}",
        )
    if not tcp_tls:
        return Verdict(
            TRANSPORT_NONE,
            f"{configured} allows neither a usable RDMA transport ({why_not_rdma}) nor tcp: "
            "transfers between pods cannot work",
        )
    if ev.rdma_asked:
        return Verdict(TRANSPORT_TCP_FALLBACK, f"TCP: {why_not_rdma}; {configured}")
    if ev.requested == "tcp":
        return Verdict(TRANSPORT_TCP, f"TCP: network.transport is tcp; {configured}")
    return Verdict(
        TRANSPORT_TCP, f"TCP: network.transport is auto and {why_not_rdma}; {configured}"
    )


def read_rdma_devices(root: str | Path = SYSFS_INFINIBAND) -> tuple[RdmaDevice, ...] | None:
    """RDMA devices under ``root`` with their ACTIVE ports; () when the folder is
    absent (no device), None when sysfs itself cannot be read."""
    base = Path(root)
    if not base.parent.is_dir():
        return None
    if not base.is_dir():
        return ()
    out = []
    try:
        for dev in sorted(base.iterdir(), key=lambda p: p.name):
            active = []
            ports = dev / "ports"
            for port in sorted(ports.iterdir()) if ports.is_dir() else ():
                try:
                    state = (port / "state").read_text()
                except OSError:
                    continue
                # e.g. "4: ACTIVE"
                if PORT_ACTIVE in state.upper() and port.name.isdigit():
                    active.append(int(port.name))
            out.append(RdmaDevice(dev.name, tuple(active)))
    except OSError:
        return None
    return tuple(out)
