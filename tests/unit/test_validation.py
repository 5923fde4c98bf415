"""The CRD schema and its CEL rules, evaluated locally (the cluster tier re-runs
the same table through a real API server)."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import yaml

from kvferry_operator import api, cli, engine_config, render, validation
from tests.manifests import EXAMPLES, INVALID, Invalid, load_example, server


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_valid(path):
    assert validation.validate(load_example(path)) == []


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_is_rejected_with_its_message(case: Invalid):
    errors = validation.validate(case.manifest)
    matching = [e for e in errors if e.path == case.path and case.message in e.message]
    assert matching, f"expected {case.path}: ...{case.message}...; got {[str(e) for e in errors]}"


# A schema node reached through a YAML alias (decode's role is prefill's, a core type's
# items are shared by every place they appear) is one node: its rules and required
# fields are one piece of schema, which one case at any of its paths covers.


def _walk_rules(schema: dict[str, Any], path: str) -> list[tuple[tuple[int, str], str]]:
    """((node, message), field path) of every CEL rule, with [] for list items."""
    found = [
        ((id(schema), " ".join(rule["message"].split())), path + rule.get("fieldPath", ""))
        for rule in schema.get("x-kubernetes-validations", [])
    ]
    for name, sub in schema.get("properties", {}).items():
        found += _walk_rules(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        found += _walk_rules(schema["items"], path + "[]")
    return found


def _walk_required(schema: dict[str, Any], path: str) -> list[tuple[tuple[int, str], str]]:
    found = [
        ((id(schema), name), f"{path}.{name}" if path else name)
        for name in schema.get("required", [])
    ]
    for name, sub in schema.get("properties", {}).items():
        found += _walk_required(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        found += _walk_required(schema["items"], path + "[]")
    return found


def _uncovered(found: list[tuple[tuple[int, str], str]], covered) -> list[str]:
    groups: dict[tuple[int, str], list[str]] = {}
    for key, path in found:
        groups.setdefault(key, []).append(path)
    return sorted(
        f"{paths[0]}: {key[1]}"
        for key, paths in groups.items()
        if not any(covered(key[1], path) for path in paths)
    )


def _normal(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


SPEC_SCHEMA = api.openapi_schema(api.SERVER_KIND)


def test_table_covers_every_cel_rule():
    # A rule added to the CRD without a case here would ship untested.
    def covered(message: str, path: str) -> bool:
        return any(_normal(c.path) == path and c.message in message for c in INVALID)

    assert _uncovered(_walk_rules(SPEC_SCHEMA, ""), covered) == []


def test_table_covers_every_required_field():
    paths = {_normal(c.path) for c in INVALID if c.message == "Required value"}
    found = [(k, p) for k, p in _walk_required(SPEC_SCHEMA, "") if not p.startswith("status")]
    assert _uncovered(found, lambda _, path: path in paths) == []


def test_table_has_at_least_fifteen_cases():
    assert len(INVALID) >= 15
    assert len({c.id for c in INVALID}) == len(INVALID)


def test_unquoted_off_gets_a_yaml_hint():
    # `mode: Off` in YAML 1.1 arrives as false; the user must learn to quote it.
    case = next(c for c in INVALID if c.id == "tuning-mode-yaml-bool")
    (err,) = validation.validate(case.manifest)
    assert "quote it" in err.message


@pytest.mark.parametrize("value", [0, 1, 7, "0%", "25%", "100%"])
def test_max_unavailable_takes_pods_or_a_percentage_as_a_pdb_does(value: int | str):
    assert validation.validate(server({"decode": {"maxUnavailable": value}})) == []


def test_a_server_that_already_has_a_status_keeps_its_name():
    # Created before the suffix rule: the API server must still take its spec edits
    # and the operator's status writes (create drops status, so new ones are checked).
    existing = {**server(name="chat-decode"), "status": {"observedGeneration": 1}}
    assert validation.validate(existing) == []


def _children(name: str) -> set[tuple[str, str]]:
    obj = api.parse_server({**server(name=name), "metadata": {"name": name, "namespace": "ns"}})
    return {(c["kind"], c["metadata"]["name"]) for c in render.render(obj)}


def test_the_names_the_crd_accepts_never_render_the_same_child():
    # Every child name of server "chat" is itself a server name someone might pick.
    names = {"chat"} | {name for _, name in _children("chat")}
    names |= {f"{n}-x" for n in set(names)}
    accepted = sorted(n for n in names if validation.validate(server(name=n)) == [])
    assert "chat" in accepted and "chat-sidecar" in accepted
    for i, a in enumerate(accepted):
        for b in accepted[i + 1 :]:
            assert not _children(a) & _children(b), (a, b)
    rejected = set(names) - set(accepted)
    assert rejected >= {"chat-decode", "chat-prefill"}


def test_a_repeated_list_map_key_is_refused_as_the_api_server_does():
    # jsonschema knows no x-kubernetes-list-type: without this, render took what
    # `kubectl apply` refuses.
    env = [{"name": "B", "value": "1"}, {"name": "B"}]
    errors = [str(e) for e in validation.validate(server({"decode": {"env": env}}))]
    assert 'spec.decode.env[1]: Duplicate value: {"name":"B"}' in errors


def test_a_repeated_list_set_item_is_refused_as_the_api_server_does():
    errors = validation.validate(server({"kvTransfer": {"backends": ["UCX", "UCX"]}}))
    assert [str(e) for e in errors] == ['spec.kvTransfer.backends[1]: Duplicate value: "UCX"']


def test_cel_rules_run_beside_a_bound_error_as_on_the_api_server():
    # Only type, enum, required and size errors stop the API server's CEL rules; the
    # user sees every other problem in one go.
    obj = server({"prefill": {"replicas": -1}, "owners": {"maxHandles": 3}})
    assert sorted(e.path for e in validation.validate(obj)) == [
        "spec.owners",
        "spec.prefill.replicas",
    ]


def test_a_pattern_is_anchored_at_the_very_end_as_in_go():
    # Go's $ is the end of the text; Python's also matches before a final newline.
    (err,) = validation.validate(server({"owners": {"header": "X-User\n"}}))
    assert err.path == "spec.owners.header" and "should match '^[A-Za-z0-9-]+$'" in err.message


def test_an_unknown_field_is_the_only_complaint_as_under_strict_decoding():
    obj = server({"prefill": {"replica": 2, "replicas": -1}})
    assert [e.path for e in validation.validate(obj)] == ["spec.prefill.replica"]


def test_a_null_the_api_server_drops_is_dropped_before_validating_and_rendering():
    # `podLabels: {team: null}` is stored as {} (nulls of non-nullable fields are
    # pruned), so render must take it too, and render it without the label.
    obj = server({"decode": {"podLabels": {"team": None}, "priorityClassName": None}})
    assert validation.validate(obj) == []
    objects, errors = cli.render_documents(io.StringIO(yaml.safe_dump(obj)))
    assert errors == []
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and "decode" in o["metadata"]["name"]
    )
    assert "team" not in sts["spec"]["template"]["metadata"]["labels"]


def test_render_refuses_what_the_operators_settings_refuse(monkeypatch: Any) -> None:
    """Offline render prints only what the operator would apply: a podTemplate host
    namespace is an error naming the field and the setting, unless the settings the
    operator reads allow it."""
    obj = server({"decode": {"podTemplate": {"spec": {"hostNetwork": True}}}})
    monkeypatch.delenv("KVFERRY_POD_TEMPLATE_ALLOW", raising=False)
    objects, errors = cli.render_documents(io.StringIO(yaml.safe_dump(obj)))
    assert objects == [] and len(errors) == 1
    assert "spec.decode.podTemplate.spec.hostNetwork" in errors[0]
    assert "settings.podTemplateAllow" in errors[0]
    monkeypatch.setenv("KVFERRY_POD_TEMPLATE_ALLOW", "hostNamespaces")
    objects, errors = cli.render_documents(io.StringIO(yaml.safe_dump(obj)))
    assert errors == [] and objects


def _extra_arg_rules() -> list[dict[str, Any]]:
    spec = SPEC_SCHEMA["properties"]["spec"]["properties"]
    lists = [spec["model"], spec["prefill"], spec["decode"]]
    return [
        r for s in lists for r in s["properties"]["extraArgs"]["items"]["x-kubernetes-validations"]
    ]


def test_the_crd_refuses_exactly_the_flags_the_operator_sets():
    # One list (engine_config.OWNED_FLAGS): the CRD's rule is its pattern, and its
    # message names every flag and the field that sets it instead.
    for rule in _extra_arg_rules():
        assert rule["rule"] == f"!self.matches('{engine_config.OWNED_FLAGS_PATTERN}')"
        message = " ".join(rule["message"].split())
        for flag, field in engine_config.OWNED_FLAGS.items():
            assert flag in message and field in message, (flag, field)


@pytest.mark.parametrize(
    "arg",
    [
        "--port",
        "--port=9000",
        "--po",
        "--kv-transfer-config.kv_role",
        "--kv_events_config",
        "-tp",
        "-tp=2",
        "--served-model-name",
        "--max_model_len=8",
        "--revision",
    ],
)
def test_an_owned_flag_in_extra_args_is_refused(arg):
    (err,) = validation.validate(server({"decode": {"extraArgs": [arg, "x"]}}))
    assert err.path == "spec.decode.extraArgs[0]"


@pytest.mark.parametrize(
    "arg",
    ["--enforce-eager", "--max-num-seqs=8", "--portal", "--kv-cache-dtype", "9000", "--dtype-x"],
)
def test_other_engine_flags_are_taken(arg):
    assert validation.validate(server({"decode": {"extraArgs": [arg]}})) == []


def test_a_cpu_server_may_say_gpus_zero():
    # The schema's minimum 0 and the rules agree: 0 is the CPU server's.
    spec = {
        "engine": {"device": "cpu", "image": "kvferry-vllm-cpu:v0.32.0"},
        "prefill": {"resources": {"gpus": 0}},
    }
    assert validation.validate(server(spec)) == []


def test_a_duplicate_env_name_gets_both_the_api_servers_error_and_the_fix():
    env = [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]
    errors = [str(e) for e in validation.validate(server({"prefill": {"env": env}}))]
    assert errors == [
        'spec.prefill.env[1]: Duplicate value: {"name":"A"}',
        "spec.prefill.env: env names each variable once (an entry replaces kvferry's of the "
        "same name, so two entries would leave which one wins unsaid): keep one entry per name.",
    ]


def test_a_quantity_with_a_trailing_newline_is_refused_as_the_api_server_does():
    # Go's $ is the end of the text; Python's would also match before a final newline.
    (err,) = validation.validate(server({"prefill": {"resources": {"memory": "1Gi\n"}}}))
    assert err.path == "spec.prefill.resources.memory"
    assert err.message.startswith("must be a Kubernetes quantity")
