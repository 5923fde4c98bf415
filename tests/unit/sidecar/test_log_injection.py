"""Log injection: a client's value in a sidecar log line stays one field.

The sidecar's lines are ``event key=value ...``: a log pipeline reads them as logfmt.
Every value a client controls (its X-Request-Id, the request path, what an error
quotes) goes through ``logfmt.value``: bare when it is a plain token, else a JSON
string (spaces, ``=``, quotes, line breaks and control characters escaped). Each line
is parsed back here with a small logfmt reader: exactly the keys the line has, the
hostile value read back whole."""

from __future__ import annotations

import json
import logging
import re

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from kvferry_sidecar import app, httplog, logfmt, metrics
from kvferry_sidecar.types import Api, TurnReport
from kvferry_wire.protocol import HDR_REQUEST_ID, Outcome, Route

_TOKEN = re.compile(r'([^\s="]+)=("(?:[^"\\]|\\.)*"|[^\s"]*)|([^\s="]+)')


def parse(line: str) -> dict[str, str]:
    """A logfmt line's fields (words without ``=`` are prose, skipped); raises on
    anything a reader could take two ways: a line break, a stray quote, a token
    not followed by a space."""
    assert len(line.splitlines()) == 1, f"not one line: {line!r}"
    assert not any(c < " " or c == "\x7f" for c in line), f"a control character: {line!r}"
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(line):
        if line[pos] == " ":
            pos += 1
            continue
        m = _TOKEN.match(line, pos)
        assert m is not None and (m.end() == len(line) or line[m.end()] == " "), line[pos:]
        if m.group(1) is not None:
            key, raw = m.group(1), m.group(2)
            assert key not in fields, f"{key} twice: {line!r}"
            fields[key] = json.loads(raw) if raw.startswith('"') else raw
        pos = m.end()
    return fields


HOSTILE = st.one_of(
    st.sampled_from(
        [
            "a status=500",
            "x\nstatus=500 level=ERROR",
            "x\rstatus=500",
            'say "hi" status=500',
            'x" status="500',
            "\x1b[31mred\x1b[0m status=500",
            "line\u2028status=500\u2029x\x85y",
            "tab\tstatus=500",
            "back\\slash\\ status=500",
            "=",
            "",
            " ",
            '"',
            "\x7f\x00\x0b\x0c\x1c",
        ]
    ),
    st.text(alphabet=st.sampled_from(" ='\"\\\n\r\t\x1b\x00\u2028\u2029\x85aZ9:-_/"), max_size=30),
    st.text(max_size=20),
)
# An X-Request-Id that is not printable gets a 400 before any log line.
PRINTABLE = HOSTILE.filter(str.isprintable)


@given(value=HOSTILE)
def test_a_value_reads_back_whole_as_one_field(value: str) -> None:
    assert parse(f"event a=1 v={logfmt.value(value)} b=2") == {"a": "1", "v": value, "b": "2"}


@pytest.mark.parametrize("plain", ["abc", "r-1.2_3", "http://p-0:8200/v1", "user@x"])
def test_a_plain_token_stays_bare(plain: str) -> None:
    assert logfmt.value(plain) == plain
    assert logfmt.value(None) == "-"


ACCESS_KEYS = {"method", "path", "status", "request_id", "client_request_id", "seconds"}


async def _access_line(path: str, request_id: str, caplog: pytest.LogCaptureFixture) -> str:
    request = make_mocked_request(
        "GET", str(URL.build(path=path, encoded=False)), headers={HDR_REQUEST_ID: request_id}
    )

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=app.log.name):
        await app.request_id_middleware(request, handler)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("access ")]
    return record.getMessage()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request_id=PRINTABLE, tail=HOSTILE)
async def test_the_access_line_keeps_the_clients_id_and_path_one_field_each(
    caplog: pytest.LogCaptureFixture, request_id: str, tail: str
) -> None:
    """The DEBUG access line wrote X-Request-Id as a Python repr: ``'a status=500'``
    read as two fields to a logfmt reader, the second ``status=500``."""
    path = "/v1/" + tail
    line = await _access_line(path, request_id, caplog)
    fields = parse(line)
    assert set(fields) == ACCESS_KEYS, line
    assert fields["client_request_id"] == request_id
    assert fields["path"] == path
    assert fields["status"] == "200"


TURN_KEYS = set(
    [
        "request_id",
        "client_request_id",
        "session",
        "owner",
        "api",
        "stream",
        "status",
        "outcome",
        "route",
        "prefill_engine",
        "attempts",
        "prompt_tokens",
        "aligned",
        "reused",
        "gap_s",
        "handle_kept",
        "not_kept",
        "finish",
        "queue_s",
        "prefill_s",
        "p_to_d_s",
        "ttft_s",
        "total_s",
        "reanchor_s",
        "decode_s",
        "placed_by",
        "p_path_s",
        "alone_s",
        "interference_s",
        "decode_holds",
        "error",
    ]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(client_id=PRINTABLE, error=HOSTILE, finish=HOSTILE)
def test_the_turn_line_keeps_every_free_text_value_one_field(
    caplog: pytest.LogCaptureFixture, client_id: str, error: str, finish: str
) -> None:
    report = TurnReport(
        request_id="r1",
        session="s1",
        api=Api.CHAT,
        stream=True,
        outcome=Outcome.REUSED,
        route=Route.REMOTE,
        client_request_id=client_id,
        finish_reason=finish,
        error=error,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=metrics.log.name):
        metrics.log_turn(report)
    (record,) = caplog.records
    fields = parse(record.getMessage())
    assert set(fields) == TURN_KEYS, record.getMessage()
    assert fields["client_request_id"] == client_id
    assert (fields["error"], fields["finish"]) == (error or "-", finish or "-")


@given(remote=HOSTILE)
def test_the_malformed_request_line_keeps_the_remote_one_field(remote: str) -> None:
    from aiohttp import http_exceptions as hx

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    httplog.log.addHandler(keep)
    try:
        server_log = httplog.ServerLog(logging.getLogger("aiohttp.server"), lambda _: None)
        server_log.exception("Error handling request", remote, exc_info=hx.BadStatusLine("x"))
    finally:
        httplog.log.removeHandler(keep)
    (record,) = records
    fields = parse(record.getMessage())
    assert set(fields) == {"reason", "remote", "quiet_since_last"}
    assert fields["remote"] == remote
