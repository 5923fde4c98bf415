"""The CRD is read once per process, however many handler threads ask at once
(operator/api.py load_crd: at the first burst of servers each of 32 threads read and
held a parse of its own)."""

from __future__ import annotations

import threading
from unittest import mock

from kvferry_operator import api


def test_threads_that_ask_at_once_share_one_read():
    api._CRDS.clear()
    go = threading.Barrier(16)
    got: list[dict] = []
    real = api.yaml.load
    with mock.patch.object(api.yaml, "load", side_effect=real) as load:

        def ask() -> None:
            go.wait()
            got.append(api.load_crd(api.SERVER_KIND))

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert load.call_count == 1
    assert len(got) == 16 and all(g is got[0] for g in got)
    assert got[0]["spec"]["names"]["kind"] == api.SERVER_KIND
