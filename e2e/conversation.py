#!/usr/bin/env python3
"""Multi-turn chat through a kvferry Service (e2e/run.sh starts the port-forward).

Each turn extends the previous prompt with the model's answer and a new user
message, under one session_id, alternating non-streaming and streaming requests.
Prints one line per turn (status, latency, time to first byte, tokens) and exits
non-zero when a turn fails. Standard library only: it runs on any machine with
Python 3.9+.

    e2e/conversation.py --url http://127.0.0.1:18000 --model Qwen/Qwen3-8B --turns 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid

QUESTIONS = [
    "List three facts about the Rhine river.",
    "Now compare it with the Danube in two sentences.",
    "Which of the two would you sail first, and why?",
    "Summarise our conversation in one sentence.",
]


def turn(url: str, model: str, session: str, messages: list, stream: bool, max_tokens: int):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "session_id": session,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Session-Id": session},
        method="POST",
    )
    started = time.monotonic()
    first = None
    text = ""
    usage = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        if not stream:
            first = time.monotonic()
            out = json.loads(resp.read())
            text = out["choices"][0]["message"]["content"] or ""
            usage = out.get("usage") or {}
        else:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    first = first or time.monotonic()
                    text += delta["content"]
                usage = chunk.get("usage") or usage
    done = time.monotonic()
    return text, usage, (first or done) - started, done - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    session = f"e2e-{uuid.uuid4().hex[:12]}"
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    print(f"session {session}")
    print(f"{'turn':>4} {'mode':<6} {'first-byte':>10} {'total':>8} {'prompt':>7} {'answer':>7}")
    for i in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        stream = i % 2 == 1
        try:
            text, usage, ttfb, total = turn(
                args.url, args.model, session, messages, stream, args.max_tokens
            )
        except urllib.error.HTTPError as exc:
            print(f"turn {i + 1}: HTTP {exc.code}: {exc.read()[:500]!r}", file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError) as exc:
            print(f"turn {i + 1}: {exc}", file=sys.stderr)
            return 1
        if not text:
            print(f"turn {i + 1}: empty answer", file=sys.stderr)
            return 1
        messages.append({"role": "assistant", "content": text})
        print(
            f"{i + 1:>4} {'stream' if stream else 'plain':<6} {ttfb:>9.2f}s {total:>7.2f}s "
            f"{usage.get('prompt_tokens', '-'):>7} {usage.get('completion_tokens', '-'):>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
