"""The server-side apply patch body (kube.apply_body): YAML to the API server, so a
value holding a character YAML refuses raw, or reads as a line break, is escaped, and
everything else stays raw (YAML has no surrogate-pair escapes for an emoji)."""

from __future__ import annotations

import json

import pytest
import yaml

from kvferry_operator.kube import apply_body

# What a spec admitted by the CRD may carry into a child (a generated one did: the API
# server refused its StatefulSets, "yaml: control characters are not allowed").
VALUES = ["del \x7f", "c1 \x80\x84\x9f", "nel \x85", "ls \u2028 ps \u2029", "bom \ufeff", "\ufffe"]


@pytest.mark.parametrize("value", VALUES)
def test_what_yaml_refuses_raw_is_escaped_and_reads_back_the_same(value):
    obj = {"metadata": {"name": "x", "annotations": {"a": value}}, "args": [value]}
    body = apply_body(obj)
    assert yaml.safe_load(body.decode()) == obj  # a YAML 1.1 parser, as the API server's
    assert json.loads(body) == obj


def test_other_characters_stay_raw():
    obj = {"v": "é ü 日本 😀 tab\\t"}
    body = apply_body(obj)
    assert "😀".encode() in body and b"\\ud83d" not in body
    assert yaml.safe_load(body.decode()) == obj


def test_a_lone_surrogate_is_escaped_rather_than_failing_to_encode():
    body = apply_body({"v": "x\ud800y"})
    assert b"\\ud800" in body
