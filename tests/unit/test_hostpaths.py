"""Which node folders a server's hub cache may mount (issue 20, item 10): one test per
rule in kvferry_operator.hostpaths' docstring."""

from __future__ import annotations

import pytest

from kvferry_operator import api, hostpaths
from tests.manifests import DELETE, server

ALLOWED = ("/var/cache/kvferry", "/mnt/models")


def with_host_path(path: str) -> api.Server:
    spec = {
        "model": {
            "source": {"pvc": DELETE, "hub": {"id": "org/m", "cache": {"hostPath": {"path": path}}}}
        }
    }
    return api.parse_server(server(spec))


@pytest.mark.parametrize(
    "path",
    [
        "/var/cache/kvferry",  # a prefix allows itself
        "/var/cache/kvferry/hf",
        "/var/cache/kvferry/hf/",  # a trailing slash
        "/var/cache//kvferry/./hf",  # repeated slashes and "." components
        "/mnt/models/llama",
    ],
)
def test_paths_under_an_allowed_prefix_pass_after_normalising(path):
    assert hostpaths.allowed(path, ALLOWED)
    assert hostpaths.refusal(with_host_path(path), ALLOWED) is None


@pytest.mark.parametrize(
    "path",
    [
        "/var/cache/kvferry-evil",  # shares the prefix's characters, not its components
        "/var/cache/kv",
        "/var/cache",  # above the prefix
        "/etc",
        "/",
    ],
)
def test_a_prefix_matches_whole_components_only(path):
    assert not hostpaths.allowed(path, ALLOWED)


@pytest.mark.parametrize(
    "path",
    ["/var/cache/kvferry/../../../etc", "/var/cache/kvferry/..", "/var/cache/kvferry/a/../b"],
)
def test_a_dotdot_component_is_refused_whatever_the_prefixes(path):
    assert not hostpaths.allowed(path, ALLOWED)
    assert not hostpaths.allowed(path, ("/",))
    message = hostpaths.refusal(with_host_path(path), ALLOWED)
    assert message is not None and "'..'" in message


def test_a_relative_path_is_refused():
    assert not hostpaths.allowed("var/cache/kvferry", ALLOWED)


def test_no_prefix_by_default_refuses_every_host_path_and_names_the_fix():
    message = hostpaths.refusal(with_host_path("/var/cache/kvferry/hf"), ())
    assert message == (
        "spec.model.source.hub.cache.hostPath.path '/var/cache/kvferry/hf' is a node folder, "
        "and the operator allows none: the StatefulSets are not applied. Keep the cache on a "
        "PVC (spec.model.source.hub.cache.pvc) or leave cache unset (an emptyDir per pod), or "
        "have the operator's installer allow the folder (settings.hostPathPrefixes in the "
        "chart, KVFERRY_HOST_PATH_PREFIXES for the operator)"
    )


def test_the_refusal_lists_what_is_allowed():
    message = hostpaths.refusal(with_host_path("/etc"), ALLOWED)
    assert message is not None
    assert "is not under a folder the operator allows (/var/cache/kvferry, /mnt/models)" in message


@pytest.mark.parametrize(
    "spec",
    [
        {},  # weights on a PVC
        {"model": {"source": {"pvc": DELETE, "hub": {"id": "org/m"}}}},  # an emptyDir
        {"model": {"source": {"pvc": DELETE, "hub": {"cache": {"pvc": {"claimName": "hf"}}}}}},
    ],
    ids=["pvc", "hub-emptydir", "hub-pvc-cache"],
)
def test_servers_without_a_host_path_are_never_refused(spec):
    assert hostpaths.refusal(api.parse_server(server(spec)), ()) is None


def test_prefixes_are_read_like_path_and_normalised():
    assert hostpaths.parse_prefixes("") == ()
    assert hostpaths.parse_prefixes("/var/cache/kvferry/:/mnt//models") == (
        "/var/cache/kvferry",
        "/mnt/models",
    )


@pytest.mark.parametrize("text", ["cache/kvferry", "/var/cache/../etc"])
def test_a_bad_prefix_is_a_startup_error_naming_the_variable(text):
    with pytest.raises(ValueError, match=r"KVFERRY_HOST_PATH_PREFIXES: .* is not an absolute"):
        hostpaths.parse_prefixes(text)
