"""kvferry_dev/netns.py's tc handling, against a fake ``ip``/``tc``: a rate change replaces
the qdisc after its queue drained, teardown deletes the veth, a hung call names itself."""

from __future__ import annotations

import subprocess

import pytest

from kvferry_dev import netns
from kvferry_dev.procs import EngineError

TBF_BUSY = (
    "qdisc tbf 8001: root refcnt 2 rate 47Mbit burst 256Kb lat 400ms\n backlog 12Kb 3p requeues 0\n"
)
TBF_IDLE = (
    "qdisc tbf 8001: root refcnt 2 rate 47Mbit burst 256Kb lat 400ms\n backlog 0b 0p requeues 0\n"
)
UNSHAPED = "qdisc noqueue 0: root refcnt 2\n"


class FakeTc:
    """Answers ``tc qdisc show`` from a script per device and records every command."""

    def __init__(self, shows: dict[str, list[str]]) -> None:
        self.shows = shows
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *cmd: str, timeout: float = netns.COMMAND_TIMEOUT) -> str:
        self.calls.append(cmd)
        if cmd[:3] == ("ip", "netns", "exec"):
            cmd = cmd[4:]
        if "show" in cmd:
            script = self.shows[cmd[-1]]
            return script.pop(0) if len(script) > 1 else script[0]
        return ""

    def verbs(self) -> list[tuple[str, str]]:
        """(tc verb, device) of each change, inside the namespace or not."""
        out = []
        for cmd in self.calls:
            if cmd[:3] == ("ip", "netns", "exec"):
                cmd = cmd[4:]
            if cmd[:2] == ("tc", "qdisc") and cmd[2] in ("add", "del", "replace"):
                out.append((cmd[2], cmd[4]))
        return out


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> netns.ThrottledLink:
    monkeypatch.setattr(netns, "DRAIN_POLL", 0.0)
    return netns.ThrottledLink("kvb-p", rate_mbit=100.0)


def test_a_new_rate_replaces_the_qdisc_once_its_queue_drained(monkeypatch, link):
    # The bug: `tc qdisc del` on a tbf still queueing the last rate's traffic did not
    # return; a replace needs no delete, and the drain keeps the rates' traffic apart.
    fake = FakeTc({link.root_dev: [TBF_BUSY, TBF_BUSY, TBF_IDLE], link.ns_dev: [TBF_IDLE]})
    monkeypatch.setattr(netns, "_run", fake)
    link.set_rate(47)
    assert fake.verbs() == [("replace", link.root_dev), ("replace", link.ns_dev)]
    assert link.rate_mbit == 47


def test_an_unshaped_device_is_shaped_without_a_delete(monkeypatch, link):
    fake = FakeTc({link.root_dev: [UNSHAPED], link.ns_dev: [UNSHAPED]})
    monkeypatch.setattr(netns, "_run", fake)
    link.set_rate(200)
    assert fake.verbs() == [("replace", link.root_dev), ("replace", link.ns_dev)]


def test_unshaping_opens_the_rate_then_deletes_only_a_drained_qdisc(monkeypatch, link):
    """A pull given up half way still sends at the shaped rate: waiting for its queue to
    drain at that rate timed out (the engine tier's slow-link test); the rate is opened
    first, so it drains at once, and only the empty qdisc is deleted."""
    fake = FakeTc({link.root_dev: [TBF_BUSY, TBF_BUSY, TBF_IDLE], link.ns_dev: [UNSHAPED]})
    monkeypatch.setattr(netns, "_run", fake)
    link.set_rate(None)
    assert fake.verbs() == [("replace", link.root_dev), ("del", link.root_dev)]
    opened = next(c for c in fake.calls if "replace" in c)
    assert f"{netns.OPEN_MBIT:g}mbit" in opened


def test_a_queue_that_never_drains_fails_with_the_device_and_what_is_queued(monkeypatch, link):
    monkeypatch.setattr(netns, "DRAIN_TIMEOUT", 0.0)
    fake = FakeTc({link.root_dev: [TBF_BUSY], link.ns_dev: [TBF_IDLE]})
    monkeypatch.setattr(netns, "_run", fake)
    with pytest.raises(EngineError, match=r"kvb-p-r: 12288 bytes still queued"):
        link.set_rate(47)
    assert fake.verbs() == []


def test_teardown_deletes_the_veth_not_the_qdiscs(monkeypatch, link):
    fake = FakeTc({})
    monkeypatch.setattr(netns, "_run", fake)
    link.down()
    assert fake.calls == [("ip", "link", "del", link.root_dev), ("ip", "netns", "del", "kvb-p")]


def test_a_hung_command_fails_naming_itself(monkeypatch):
    def hang(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(netns.subprocess, "run", hang)
    with pytest.raises(EngineError, match=r"tc qdisc del dev x root did not return within 30 s"):
        netns._run("tc", "qdisc", "del", "dev", "x", "root")


@pytest.mark.parametrize(
    ("stats", "queued"),
    [(TBF_BUSY, 12 * 1024), (TBF_IDLE, 0), (UNSHAPED, 0), (" backlog 1514b 1p\n", 1514)],
)
def test_backlog_is_read_from_tc_statistics(stats, queued):
    assert netns.backlog_bytes(stats) == queued


def test_a_backlog_tc_does_not_write_is_refused():
    with pytest.raises(EngineError, match="tc backlog '12xb'"):
        netns.backlog_bytes(" backlog 12xb 3p\n")
