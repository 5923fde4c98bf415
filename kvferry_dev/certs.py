"""Serving certificates for local runs (tests, benchmarks): the operator's report
endpoint starts only with one."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 (the chart makes one the same way)."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=kvferry-operator",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
