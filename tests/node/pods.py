"""The node tier's pods: a web pod (a native sidecar beside a tiny HTTP server, read-only
root, non-root, a projected token) behind the Service `echo`."""

from __future__ import annotations

from typing import Any

from tests.node.cluster import NAMESPACE, NodeCluster

AUDIENCE = "kvferry-node-tier"
UID = 10001
# The main container notes whether the sidecar's file existed when it started, then serves
# its own name: the Service check can tell which pod answered.
SERVER = """
import os, socket
from http.server import BaseHTTPRequestHandler, HTTPServer
print("sidecar-seen-at-start", os.path.exists("/shared/sidecar-started"), flush=True)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = socket.gethostname().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""
SIDECAR = (
    "import pathlib, time; pathlib.Path('/shared/sidecar-started').write_text(str(time.time()));"
    " time.sleep(10**9)"
)
LOCKED_DOWN = {
    "runAsNonRoot": True,
    "runAsUser": UID,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}


def web_pod(image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": NAMESPACE, "labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "initContainers": [
                {
                    "name": "sidecar",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "restartPolicy": "Always",  # a native sidecar: started, and started up, first
                    "command": ["python3", "-c", SIDECAR],
                    "startupProbe": {
                        "exec": {"command": ["test", "-f", "/shared/sidecar-started"]},
                        "periodSeconds": 1,
                    },
                    "securityContext": LOCKED_DOWN,
                    "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                }
            ],
            "containers": [
                {
                    "name": "web",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", SERVER],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {
                        "httpGet": {"path": "/", "port": "http"},
                        "periodSeconds": 1,
                    },
                    "securityContext": LOCKED_DOWN,
                    "volumeMounts": [
                        {"name": "shared", "mountPath": "/shared"},
                        {"name": "token", "mountPath": "/var/run/secrets/tokens", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "shared", "emptyDir": {}},
                {
                    "name": "token",
                    "projected": {
                        "sources": [
                            {
                                "serviceAccountToken": {
                                    "audience": AUDIENCE,
                                    "expirationSeconds": 600,
                                    "path": "token",
                                }
                            }
                        ]
                    },
                },
            ],
        },
    }


SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "echo", "namespace": NAMESPACE},
    "spec": {
        "selector": {"app": "web"},
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
    },
}


def in_pod(nodes: NodeCluster, code: str, container: str = "web") -> str:
    return nodes.kubectl.run(
        "exec", "-n", NAMESPACE, "web", "-c", container, "--", "python3", "-c", code
    ).stdout
