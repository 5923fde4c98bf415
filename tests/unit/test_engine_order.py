"""The engine tier's module order (tests/engine/order.py): engines of their own first,
the control plane last, alphabetical within each group."""

from __future__ import annotations

from tests.engine.order import run_order


def test_own_engines_first_control_plane_last_stable_within_groups() -> None:
    modules = [
        ("test_a_pair.py", {"engine_pair", "sidecar"}),
        ("test_b_status.py", {"engine_pair", "kubeconfig", "kubectl"}),
        ("test_c_demo.py", {"engine_python", "tiny_model"}),
        ("test_d_pair.py", {"prefill", "engine_pair"}),
        ("test_e_link.py", {"engine_python", "tiny_model", "bytes_per_token"}),
    ]
    assert run_order(modules) == [
        "test_c_demo.py",
        "test_e_link.py",
        "test_a_pair.py",
        "test_d_pair.py",
        "test_b_status.py",
    ]


def test_a_module_needing_the_control_plane_without_the_pair_still_goes_last() -> None:
    assert run_order([("k.py", {"kubeconfig"}), ("p.py", {"engine_pair"})]) == ["p.py", "k.py"]
