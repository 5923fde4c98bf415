"""One chat turn from inside a pod (stdlib only: it runs on the pods' Debian python3).

``kubectl exec POD -- python3 -c "$(cat this file)" REQUEST_JSON``. REQUEST_JSON:
``{"url", "body", "headers", "deadline_s", "timeout_s"}``. A refused connection, a reset before the
answer, or a 503 is retried (after ``Retry-After`` where given, at most 5 s) until the
deadline, as a client of a Service whose pods are being replaced would. Prints JSON
lines: ``{"event": "first-byte"}`` once the first streamed content arrives (the test
waits on it to know a turn is in flight), then ``{"event": "done", ...}`` with the status,
the kvferry headers, the text, the streamed chunk count and every retried attempt.
"""

import http.client
import json
import sys
import time
import urllib.error
import urllib.request


def say(**fields):
    print(json.dumps(fields), flush=True)


def attempt(url, body, headers, timeout):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        kept = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-kvferry")}
        if not body.get("stream"):
            out = json.loads(resp.read())
            return resp.status, kept, out["choices"][0]["message"]["content"] or "", 0
        text, chunks, done, last_at = "", 0, False, None
        try:
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data:") or done:
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if chunks == 0:
                            say(event="first-byte")
                        chunks += 1
                        text += piece
                        last_at = time.time()
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise Cut(f"{type(exc).__name__}: {exc}", text, chunks) from exc
        if not done:  # the stream ended without [DONE]: cut, not answered
            raise Cut("no [DONE]", text, chunks)
        kept["last-chunk-at"] = str(last_at)  # the node's clock, as the API server's
        return resp.status, kept, text, chunks


class Cut(Exception):
    """A stream that ended after it began: never retried (the client saw part of it)."""

    def __init__(self, why, text, chunks):
        super().__init__(why)
        self.text, self.chunks = text, chunks


def main():
    req = json.loads(sys.argv[1])
    headers = {"Content-Type": "application/json", **req.get("headers", {})}
    deadline = time.monotonic() + req.get("deadline_s", 300)
    retried = []
    while True:
        wait = 1.0
        try:
            status, kept, text, chunks = attempt(
                req["url"], req["body"], headers, req.get("timeout_s", 600)
            )
            say(
                event="done", status=status, headers=kept, text=text, chunks=chunks, retried=retried
            )
            return 0
        except Cut as exc:
            say(
                event="done",
                status=-1,
                headers={},
                text=exc.text,
                chunks=exc.chunks,
                retried=retried,
                cut=str(exc),
            )
            return 1
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                say(
                    event="done",
                    status=exc.code,
                    headers={},
                    text=exc.read().decode()[:2000],
                    chunks=0,
                    retried=retried,
                )
                return 0
            after = exc.headers.get("Retry-After")
            retried.append(
                {
                    "status": 503,
                    "retry_after": after,
                    "draining": exc.headers.get("X-Kvferry-Draining"),
                }
            )
            if after and after.isdigit():
                wait = min(5.0, float(after))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            # urllib wraps what fails before the request is sent (the connect) in
            # URLError; anything else failed once the server had the request.
            phase = "connect" if isinstance(exc, urllib.error.URLError) else "response"
            retried.append(
                {
                    "error": type(getattr(exc, "reason", exc)).__name__,
                    "phase": phase,
                    "detail": str(exc)[:200],
                }
            )
        if time.monotonic() + wait > deadline:
            say(event="done", status=0, headers={}, text="", chunks=0, retried=retried)
            return 1
        time.sleep(wait)


sys.exit(main())
