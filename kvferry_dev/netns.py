"""A P<->D link of a chosen bandwidth on one machine: the prefill engine in its own
network namespace, joined to the root namespace by a veth pair whose two ends are
shaped with ``tc`` (``tbf``; this kernel has no ``netem``). Needs root.

    with ThrottledLink("kvb") as link:
        link.set_rate(mbit=200)
        pair = start_netns_pair(py, model, logs, link=link, server=server)

P binds its HTTP port, NIXL side channel and UCX (``UCX_NET_DEVICES``) to the
namespace's end of the veth; D binds its side channel and UCX to the root end, so
every KV byte between them (D pulling P's prompt KV, P pulling D's handle) crosses
the shaped link, both ways. The sidecar stays in the root namespace and reaches P over
the same link (its requests are small).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .configs import kv_transfer_config, tiny_server
from .engines import START_TIMEOUT, Engine, EnginePair
from .procs import EngineError

# A /24 unlikely to collide with anything on a test machine.
ROOT_ADDR = "10.213.0.1"
NS_ADDR = "10.213.0.2"
# tbf must let a whole segment through: veth hands over GSO segments up to 64 KiB.
BURST = "256kb"
# Packets queued longer than this are dropped: keeps a slow link from buffering seconds.
LATENCY = "400ms"


# Every ip/tc call is bounded: a qdisc change on a veth with traffic queued has been
# seen not to return, and a hung call must fail the run with its command, not stall it.
COMMAND_TIMEOUT = 30.0
# How long set_rate waits for the shaped queues to empty before it changes the rate.
# The rate a queue is opened to before the shaping is removed: far above any shaped.
OPEN_MBIT = 1000.0
DRAIN_TIMEOUT = 20.0
DRAIN_POLL = 0.2


def _run(*cmd: str, timeout: float = COMMAND_TIMEOUT) -> str:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EngineError(f"{' '.join(cmd)} did not return within {timeout:g} s") from None
    if res.returncode != 0:
        raise EngineError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    return res.stdout


def backlog_bytes(tc_stats: str) -> int:
    """Bytes queued in the root qdisc, from ``tc -s qdisc show``'s ``backlog 12Kb 3p``
    (0 when the device has no shaping). Raises EngineError on a line it cannot read."""
    for line in tc_stats.splitlines():
        words = line.split()
        if words[:1] != ["backlog"] or len(words) < 2:
            continue
        size = words[1].lower()
        for suffix, scale in (("kb", 1024), ("mb", 1024**2), ("gb", 1024**3), ("b", 1)):
            if size.endswith(suffix) and size[: -len(suffix)].isdigit():
                return int(size[: -len(suffix)]) * scale
        raise EngineError(f"tc backlog {words[1]!r}: not a size tc writes")
    return 0


@dataclass
class ThrottledLink:
    """A network namespace and a veth pair into it, shaped both ways."""

    name: str = "kvferry-p"
    rate_mbit: float | None = None  # None: unshaped

    @property
    def root_dev(self) -> str:
        return f"{self.name[:10]}-r"

    @property
    def ns_dev(self) -> str:
        return f"{self.name[:10]}-p"

    def up(self) -> ThrottledLink:
        self.down()
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", self.ns_dev)
        _run("ip", "link", "set", self.ns_dev, "netns", self.name)
        _run("ip", "addr", "add", f"{ROOT_ADDR}/24", "dev", self.root_dev)
        _run("ip", "link", "set", self.root_dev, "up")
        self._ns("ip", "addr", "add", f"{NS_ADDR}/24", "dev", self.ns_dev)
        self._ns("ip", "link", "set", self.ns_dev, "up")
        self._ns("ip", "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        """Remove the veth pair, then the namespace. Deleting the root end deletes its
        peer with both qdiscs and whatever they still queue: no ``tc qdisc del`` on a
        shaped device that may still be draining."""
        with contextlib.suppress(EngineError):
            _run("ip", "link", "del", self.root_dev)
        with contextlib.suppress(EngineError):
            _run("ip", "netns", "del", self.name)

    def _ns(self, *cmd: str) -> str:
        return _run("ip", "netns", "exec", self.name, *cmd)

    def set_rate(self, mbit: float | None) -> None:
        """Shape both directions to `mbit` megabits/s (None: remove the shaping).

        A new rate replaces the tbf in place (``tc qdisc replace``: one netlink call, no
        window without shaping, no delete of a qdisc with packets queued), once the
        queue drained, so the last rate's traffic is not measured under the next one.
        Going back to unshaped first opens the rate (``OPEN_MBIT``: what is still
        queued, or still being sent, goes at once), then deletes the qdisc once its
        queue is empty. Raises EngineError naming the command that failed or hung.
        """
        for dev, run in ((self.root_dev, _run), (self.ns_dev, self._ns)):
            shaped = "tbf" in run("tc", "qdisc", "show", "dev", dev)
            if mbit is not None:
                if shaped:
                    self._drain(dev, run)
                self._tbf(dev, run, mbit)
            elif shaped:
                # Unshaping may come while a transfer still runs (a pull given up half
                # way, which goes on at the shaped rate): open the rate first, so the
                # queue drains at once, then delete the empty qdisc.
                self._tbf(dev, run, OPEN_MBIT)
                self._drain(dev, run)
                run("tc", "qdisc", "del", "dev", dev, "root")
        self.rate_mbit = mbit

    @staticmethod
    def _tbf(dev: str, run: Any, mbit: float) -> None:
        run(
            "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{mbit:g}mbit", "burst", BURST, "latency", LATENCY,
        )  # fmt: skip

    def _drain(self, dev: str, run: Any) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while True:
            queued = backlog_bytes(run("tc", "-s", "qdisc", "show", "dev", dev))
            if queued == 0:
                return
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"{dev}: {queued} bytes still queued after {DRAIN_TIMEOUT:g} s at "
                    f"{self.rate_mbit} Mbit/s: is a transfer still running?"
                )
            time.sleep(DRAIN_POLL)  # waiting on the kernel's queue, not on a test

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def __enter__(self) -> ThrottledLink:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


@dataclass(eq=False)
class LinkedEngine(Engine):
    """An engine bound to one end of a ThrottledLink (P inside the namespace)."""

    link: ThrottledLink | None = None
    inside: bool = False  # in the namespace (P) or on the root end (D)
    ucx_extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return NS_ADDR if self.inside else ROOT_ADDR

    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        args = super().argv()
        i = args.index("--host")
        args[i + 1] = self.host
        if self.inside and self.link is not None:
            args = [*self.link.exec_prefix(), *args]
        return args

    def env(self) -> dict[str, str]:
        env = super().env()
        assert self.link is not None
        env.update(
            {
                "VLLM_HOST_IP": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "UCX_NET_DEVICES": self.link.ns_dev if self.inside else self.link.root_dev,
            }
        )
        env.update(self.ucx_extra_env)
        return env


def start_linked_pair(
    python: Path | str,
    model: Path | str,
    log_dir: Path | str,
    *,
    link: ThrottledLink,
    server: Any = None,
    cpus: tuple[int | None, int | None] = (0, 1),
    timeout: float = START_TIMEOUT,
    extra_env: dict[str, str] | None = None,
) -> EnginePair:
    """P (in the link's namespace, no prefix cache) and D (root end), started and
    healthy; on failure both are stopped."""
    log_dir = Path(log_dir)
    server = server or tiny_server()
    engines = []
    for role, cpu, inside in (("prefill", cpus[0], True), ("decode", cpus[1], False)):
        engines.append(
            LinkedEngine(
                role=role,
                python=Path(python),
                model=Path(model),
                kv_transfer_config=kv_transfer_config(role, server),
                log_path=log_dir / f"{role}.log",
                cpu=cpu,
                extra_env=dict(extra_env or {}),
                prefix_caching=role == "decode",
                link=link,
                inside=inside,
            )
        )
    pair = EnginePair(*engines)
    deadline = time.monotonic() + timeout
    try:
        for e in pair:
            e.start()
        for e in pair:
            e.wait_healthy(max(1.0, deadline - time.monotonic()))
    except BaseException:
        pair.stop()
        raise
    return pair
