"""The transport verdict: what the sidecar can observe about the P<->D KV path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry_sidecar import config
from kvferry_sidecar.runtime import Sidecar
from kvferry_sidecar.transport import Evidence, RdmaDevice, classify, read_rdma_devices, tls_allows

MLX = (RdmaDevice("mlx5_0", (1,)),)
DOWN = (RdmaDevice("mlx5_0", ()),)
RDMA_TLS = "ib,cuda_copy,cuda_ipc,gdr_copy,sm,self"  # what the operator renders for rdma
TCP_TLS = "tcp,cuda_copy,cuda_ipc,sm,self"  # ... and for tcp


@pytest.mark.parametrize(
    ("tls", "rdma", "tcp"),
    [
        (None, True, True),
        ("all", True, True),
        (RDMA_TLS, True, False),
        (TCP_TLS, False, True),
        ("tcp,self", False, True),
        ("rc_x,tcp:aux", True, True),
        ("^tcp", True, False),
        (
            "^ib,rc,rc_v,rc_x,rc_verbs,rc_mlx5,dc,dc_x,dc_mlx5,ud,ud_v,ud_x,ud_verbs,ud_mlx5,srd",
            False,
            True,
        ),
        ("sm,self", False, False),
    ],
)
def test_ucx_tls_lists_and_exclusions(tls, rdma, tcp):
    from kvferry_sidecar.transport import RDMA_TLS as RDMA_NAMES

    assert tls_allows(tls, RDMA_NAMES) is rdma
    assert tls_allows(tls, frozenset({"tcp"})) is tcp


@pytest.mark.parametrize(
    ("evidence", "transport", "fragment"),
    [
        # Our CPU machines: the engine tier's UCX settings, no RDMA device.
        (
            Evidence(ucx_tls="tcp,self", ucx_net_devices="lo"),
            "TCP",
            "network.transport is auto and UCX_TLS allows no RDMA",
        ),
        (Evidence(), "TCP", "network.transport is auto and no RDMA device in the pod"),
        (Evidence(rdma_enabled=True), "TCPFallback", "TCP: no RDMA device in the pod"),
        (
            Evidence(requested="rdma", rdma_enabled=True, ucx_tls=TCP_TLS, rdma_devices=()),
            "TCPFallback",
            "TCP: UCX_TLS allows no RDMA",
        ),
        (
            Evidence(requested="tcp", ucx_tls=TCP_TLS, rdma_devices=MLX),
            "TCP",
            "network.transport is tcp",
        ),
        (
            Evidence(requested="rdma", rdma_enabled=True, ucx_tls=RDMA_TLS, rdma_devices=MLX),
            "RDMA",
            "mlx5_0 active",
        ),
        (Evidence(rdma_devices=MLX), "RDMA", "UCX_TLS=unset allows RDMA"),
        (Evidence(rdma_devices=DOWN), "TCP", "no ACTIVE port"),
        (Evidence(rdma_enabled=True, rdma_devices=DOWN), "TCPFallback", "no ACTIVE port"),
        (
            Evidence(ucx_net_devices="eth0", rdma_devices=MLX),
            "TCP",
            "UCX_NET_DEVICES names no",
        ),
        (Evidence(ucx_net_devices="mlx5_0:1", rdma_devices=MLX), "RDMA", "mlx5_0"),
        (Evidence(rdma_devices=None), "Unknown", "cannot read"),
        (
            Evidence(requested="rdma", ucx_tls=RDMA_TLS),
            "NoTransport",
            "transfers between pods cannot work",
        ),
        (Evidence(ucx_tls="tcp", rdma_devices=None), "TCP", "UCX_TLS allows no RDMA"),
    ],
    ids=[
        "engine-tier",
        "auto-no-device",
        "rdma-enabled-no-device",
        "rdma-asked-tcp-tls-no-device",
        "tcp-asked",
        "rdma-asked-and-there",
        "auto-with-device",
        "port-down",
        "rdma-enabled-port-down",
        "net-devices-exclude",
        "net-devices-include",
        "sysfs-unreadable",
        "rdma-only-tls-no-device",
        "tls-decides-without-sysfs",
    ],
)
def test_verdicts(evidence: Evidence, transport: str, fragment: str):
    verdict = classify(evidence)
    assert verdict.transport == transport
    assert fragment in verdict.reason


def _port(root: Path, dev: str, port: int, state: str) -> None:
    d = root / dev / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")


def test_sysfs_devices_and_active_ports(tmp_path: Path):
    root = tmp_path / "infiniband"
    _port(root, "mlx5_1", 1, "1: DOWN")
    _port(root, "mlx5_0", 1, "4: ACTIVE")
    assert read_rdma_devices(root) == (RdmaDevice("mlx5_0", (1,)), RdmaDevice("mlx5_1", ()))
    assert read_rdma_devices(tmp_path / "absent") == ()
    assert read_rdma_devices(tmp_path / "no" / "such" / "dir") is None


def test_the_report_carries_the_verdict_from_settings_and_sysfs(tmp_path: Path):
    _port(tmp_path / "infiniband", "mlx5_0", 1, "4: ACTIVE")
    settings = config.build(
        {
            "role": "decode",
            "requested_transport": "rdma",
            "rdma_enabled": True,
            "rdma_sysfs": str(tmp_path / "infiniband"),
        },
        env={"KVFERRY_ENGINE_UCX_TLS": RDMA_TLS},
    )
    snap = Sidecar(settings).snapshot()
    assert snap.transport == "RDMA"
    assert "mlx5_0 active" in snap.transport_reason and RDMA_TLS in snap.transport_reason


def test_settings_file_keys_the_operator_writes(tmp_path: Path):
    path = tmp_path / "sidecar.json"
    path.write_text('{"transport": "tcp", "rdmaEnabled": false, "engineUcxTls": "tcp,self"}')
    s = config.build({"settings_path": str(path)}, env={})
    assert (s.requested_transport, s.rdma_enabled, s.engine_ucx_tls) == ("tcp", False, "tcp,self")


def test_an_unknown_requested_transport_is_a_config_error():
    with pytest.raises(config.ConfigError, match="transport must be auto, rdma or tcp"):
        config.build({"requested_transport": "infiniband"}, env={})
