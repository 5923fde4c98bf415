"""Kube's lists read the API server's JSON as plain dicts, page by page (the dynamic
client's objects cost seconds of CPU per list of a few thousand objects)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kvferry_operator.kube import Kube


class Pages:
    """A resource whose list answers in two pages, as the API server does."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def get(self, **params: Any) -> SimpleNamespace:
        self.calls.append(params)
        assert params["serialize"] is False
        first = params["_continue"] is None
        body = {
            "apiVersion": "v1",
            "kind": "ServiceList",
            "metadata": {"continue": "next"} if first else {},
            "items": [{"metadata": {"name": "a" if first else "b"}}],
        }
        return SimpleNamespace(data=json.dumps(body).encode())


def test_a_list_is_read_page_by_page_and_each_item_names_its_kind():
    kube = Kube.__new__(Kube)
    pages = Pages()
    kube._resource = lambda api_version, kind: pages  # type: ignore[method-assign]
    items = kube.list_labelled("v1", "Service", "app=x", ["ns"], page=1)
    # A list's items carry no apiVersion and kind: a render compared with them has both.
    assert items == [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b"}},
    ]
    assert [c["_continue"] for c in pages.calls] == [None, "next"]
    assert pages.calls[0]["label_selector"] == "app=x" and pages.calls[0]["namespace"] == "ns"
