"""The operator's only door to the API server: server-side apply, status patches, events.

Every write goes through here with one field manager, so ``kubectl get
--show-managed-fields`` tells a GitOps tool's fields (the server spec) from
ours (children and status) at a glance.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException

from . import api

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Every call has a deadline (connect, read): an API server that accepts a connection
# and never answers (restarting, overloaded) must not hold a thread forever.
REQUEST_TIMEOUT = (5.0, 30.0)
# A list's items as metadata only (meta.k8s.io PartialObjectMetadataList).
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def api_error_message(exc: ApiException) -> str:
    """The API server's own sentence, not the client's header dump."""
    try:
        return f"{exc.status} {json.loads(exc.body)['message']}"
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def is_transient(exc: BaseException) -> bool:
    """The API server is down, restarting or overloaded: try again later (the resync
    loop and the next watch event do), and say so in one line, not a traceback."""
    if isinstance(exc, ApiException):
        # Server-side apply answers a field its schema lacks (a misspelt field in a
        # pod template) with a 500 "failed to create typed patch object": the same
        # object fails the same way, so it is a refusal, not an outage.
        body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
        if "failed to create typed patch object" in (body or ""):
            return False
        return exc.status in (0, 408, 429) or (exc.status or 0) >= 500
    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError, TimeoutError))


def _as_dict(_client: Any, data: Obj) -> Obj:
    """The dynamic client's serializer for plain dicts: its own objects (a
    ``ResourceField`` per field, made for every answer and turned back by ``to_dict``)
    cost CPU and memory per request that 32 handler threads multiply (issue 23,
    item 4); every caller here wants the dict."""
    return data


def is_namespace_terminating(exc: ApiException) -> bool:
    return exc.status == 403 and "because it is being terminated" in (exc.body or "")


# Characters YAML takes only escaped (DEL, the C1 controls, U+FFFE/U+FFFF, a lone
# surrogate, which UTF-8 cannot even encode) or reads as line breaks (NEL, U+2028,
# U+2029: a YAML 1.1 parser folds them): JSON without ensure_ascii leaves them raw.
_YAML_RAW_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")


def apply_body(obj: Obj) -> bytes:
    """``obj`` as an apply patch, which is YAML to the API server. UTF-8 JSON is YAML,
    but not all of it: YAML has no surrogate-pair escapes (the client's own json.dumps
    writes an emoji as "\\ud83d\\ude00", which the API server refuses: 400 "invalid
    Unicode character escape code"), so characters stay raw, except those YAML takes
    only escaped, which get JSON's \\u escape (YAML reads it the same)."""
    text = json.dumps(obj, ensure_ascii=False)
    return _YAML_RAW_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode()


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api_client = api_client
        self.dyn = dynamic.DynamicClient(api_client)

    def close(self) -> None:
        self.api_client.close()

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply ``obj`` as ours; forced, since these are our children."""
        meta = obj["metadata"]
        res = self._resource(obj["apiVersion"], obj["kind"])
        out = self.dyn.request(
            "patch",
            res.path(name=meta["name"], namespace=meta.get("namespace")),
            body=apply_body(obj),
            content_type="application/apply-patch+yaml",
            field_manager=api.FIELD_MANAGER,
            force_conflicts=True,
            _request_timeout=REQUEST_TIMEOUT,
            serializer=_as_dict,
        )
        return out

    def list_metadata(
        self, api_version: str, kind: str, namespace: str, page: int = 500
    ) -> list[Obj]:
        """The metadata (without managedFields) of every object of a kind in ``namespace``,
        in pages: the API server answers a PartialObjectMetadataList, no spec or status,
        so a namespace's StatefulSets cost a few KB each less to fetch and to hold."""
        out: list[Obj] = []
        headers = {"Accept": METADATA_LIST}
        for item in self._pages(api_version, kind, namespace, page, header_params=headers):
            meta = dict(item.get("metadata") or {})
            meta.pop("managedFields", None)
            out.append({"metadata": meta})
        return out

    def _pages(
        self, api_version: str, kind: str, namespace: str | None, page: int, **params: Any
    ) -> Iterator[Obj]:
        """Every item of a list, page by page (a large list is never one huge answer),
        as plain dicts from the JSON: the dynamic client's own objects (a ResourceField
        per field, then ``to_dict``) cost seconds of CPU and hundreds of MB per list of a
        few thousand objects, which at 1,000 servers in a namespace starved everything."""
        res = self._resource(api_version, kind)
        token: str | None = None
        while True:
            got = res.get(
                namespace=namespace,
                limit=page,
                _continue=token,
                _request_timeout=REQUEST_TIMEOUT,
                serialize=False,
                **params,
            )
            body = json.loads(got.data)
            # A list's items carry no apiVersion and kind; the dynamic client's objects
            # added them, and what compares them with a render needs them.
            api_version_of, kind_of = body.get("apiVersion"), body.get("kind", "")
            for item in body.get("items") or []:
                item.setdefault("apiVersion", api_version_of)
                item.setdefault("kind", kind_of.removesuffix("List"))
                yield item
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return

    def get(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> Obj | None:
        try:
            res = self._resource(api_version, kind)
            return res.get(
                name=name, namespace=namespace, _request_timeout=timeout, serializer=_as_dict
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, obj: Obj) -> Obj | None:
        """Create ``obj`` (a POST, not an apply: for an object whose fields the operator
        sets once and then leaves to others, a RoleScaler's spec.replicas). None when
        one of that name exists already (the caller reads it)."""
        meta = obj["metadata"]
        res = self._resource(obj["apiVersion"], obj["kind"])
        try:
            out = res.create(
                body=obj,
                namespace=meta.get("namespace"),
                field_manager=api.FIELD_MANAGER,
                _request_timeout=REQUEST_TIMEOUT,
                serializer=_as_dict,
            )
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return out

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the object if it is still the one with ``uid`` (a precondition: never
        one someone created again under that name meanwhile); gone is not an error."""
        res = self._resource(api_version, kind)
        try:
            res.delete(
                name=name,
                namespace=namespace,
                body={"preconditions": {"uid": uid}},
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    # The leader election's Lease (leader.py): read, created once, replaced with the
    # read's resourceVersion (a 409 means another replica wrote first: read again).
    LEASE = ("coordination.k8s.io/v1", "Lease")

    def get_lease(self, namespace: str, name: str) -> Obj | None:
        return self.get(*self.LEASE, namespace, name, timeout=(3.0, 5.0))

    def create_lease(self, namespace: str, name: str, spec: Obj) -> bool:
        obj = {
            "apiVersion": self.LEASE[0],
            "kind": self.LEASE[1],
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
        return self.create(obj) is not None

    def replace_lease(self, namespace: str, name: str, spec: Obj, resource_version: str) -> bool:
        res = self._resource(*self.LEASE)
        body = {
            "apiVersion": self.LEASE[0],
            "kind": self.LEASE[1],
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version},
            "spec": spec,
        }
        try:
            res.replace(
                body=body,
                name=name,
                namespace=namespace,
                field_manager=api.FIELD_MANAGER,
                _request_timeout=(3.0, 5.0),
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def label_pod(self, namespace: str, name: str, labels: dict[str, str | None]) -> bool:
        """Merge-patch labels onto a pod (None removes one); False when the pod is gone.
        For the operator's own pod only (leader.PodMark): the chart's Role grants
        patch on pods in the release namespace alone."""
        try:
            client.CoreV1Api(self.api_client).patch_namespaced_pod(
                name,
                namespace,
                {"metadata": {"labels": labels}},
                field_manager=api.FIELD_MANAGER,
                _request_timeout=(3.0, 5.0),
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Obj
    ) -> None:
        """Merge-patch ``status`` as our field manager (managedFields then say who
        wrote each status field); a server deleted meanwhile is not an error."""
        res = self._resource(api_version, kind)
        try:
            res.status.patch(
                body={"status": status},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
                field_manager=api.FIELD_MANAGER,
                _request_timeout=REQUEST_TIMEOUT,
                serializer=_as_dict,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def list_servers(self, namespaces: list[str] | None = None) -> list[Obj]:
        """All servers, or those in ``namespaces`` (a namespace-restricted install may
        not list cluster-wide)."""
        return [
            item
            for ns in namespaces or [None]
            for item in self._pages(api.API_VERSION, api.SERVER_KIND, ns, 500)
        ]

    def list_labelled(
        self,
        api_version: str,
        kind: str,
        label_selector: str,
        namespaces: list[str] | None = None,
        page: int = 500,
    ) -> list[Obj]:
        """Every object of a kind with the labels, in pages of ``page`` (a large
        cluster's list is never one huge answer), cluster-wide or per namespace."""
        out: list[Obj] = []
        for ns in namespaces or [None]:
            out.extend(self._pages(api_version, kind, ns, page, label_selector=label_selector))
        return out

    def review_token(
        self, token: str, audience: str, timeout: tuple[float, float] = REQUEST_TIMEOUT
    ) -> Obj:
        """TokenReview: who the API server says the token belongs to."""
        review = client.AuthenticationV1Api(self.api_client).create_token_review(
            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[audience])),
            _request_timeout=timeout,
        )
        return self.api_client.sanitize_for_serialization(review.status) or {}

    def get_pod(
        self, namespace: str, name: str, timeout: tuple[float, float] = REQUEST_TIMEOUT
    ) -> Obj | None:
        try:
            pod = client.CoreV1Api(self.api_client).read_namespaced_pod(
                name, namespace, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.api_client.sanitize_for_serialization(pod)

    # Reads for the prerequisite checks (prerequisites.py, through probe.py).

    def list_nodes(self) -> list[Obj]:
        """Every Node, from the API server's watch cache (resourceVersion=0: cheap
        on large clusters), as plain JSON."""
        resp = client.CoreV1Api(self.api_client).list_node(
            resource_version="0", _preload_content=False, _request_timeout=REQUEST_TIMEOUT
        )
        return json.loads(resp.data)["items"]

    def get_namespace(self, name: str) -> Obj | None:
        try:
            ns = client.CoreV1Api(self.api_client).read_namespace(
                name, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.api_client.sanitize_for_serialization(ns)

    def crd_exists(self, name: str) -> bool:
        try:
            client.ApiextensionsV1Api(self.api_client).read_custom_resource_definition(
                name, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def get_network_attachment_definition(self, namespace: str, name: str) -> Obj | None:
        try:
            return client.CustomObjectsApi(self.api_client).get_namespaced_custom_object(
                "k8s.cni.cncf.io",
                "v1",
                namespace,
                "network-attachment-definitions",
                name,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_event(self, body: Obj, type: str, reason: str, message: str) -> None:
        """An Event on ``body`` from outside a kopf handler (kopf.event needs one)."""
        meta = body["metadata"]
        now = datetime.datetime.now(datetime.UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                api_version=body.get("apiVersion", api.API_VERSION),
                kind=body.get("kind", api.SERVER_KIND),
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta.get("uid"),
            ),
            reason=reason,
            message=message[:1024],
            type=type,
            source=client.V1EventSource(component=api.FIELD_MANAGER),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        client.CoreV1Api(self.api_client).create_namespaced_event(
            meta["namespace"], event, _request_timeout=REQUEST_TIMEOUT
        )
