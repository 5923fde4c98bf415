"""``kvferry-operator``: run the operator, or render a manifest offline."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import yaml

from kvferry_wire import extras

from . import api


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (ConfigMap data) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(objects: list[dict[str, Any]], out: TextIO) -> None:
    yaml.dump_all(objects, out, Dumper=_Dumper, sort_keys=False, width=120)


def render_documents(stream: TextIO) -> tuple[list[dict[str, Any]], list[str]]:
    """Children of every DisaggregatedServer in ``stream``, and the errors found."""
    from . import hostpaths, render, validation  # the operator extra: checked in main()
    from . import settings as operator_settings

    # The operator's own refusals too (a hostPath, what a podTemplate may not set),
    # under the settings it reads (KVFERRY_HOST_PATH_PREFIXES,
    # KVFERRY_POD_TEMPLATE_ALLOW; none allowed when unset): what this prints, the
    # operator applies.
    ours = operator_settings.from_env()
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    for i, doc in enumerate(yaml.safe_load_all(stream)):
        if not doc:
            continue
        if doc.get("apiVersion") != api.API_VERSION or doc.get("kind") != api.SERVER_KIND:
            errors.append(
                f"document {i}: expected apiVersion {api.API_VERSION} and kind "
                f"{api.SERVER_KIND}, got {doc.get('apiVersion')}/{doc.get('kind')}"
            )
            continue
        name = (doc.get("metadata") or {}).get("name", f"document {i}")
        # What the API server would store: without the nulls it drops.
        doc = validation.prune_nulls(doc)
        problems = validation.validate(doc)
        if problems:
            errors += [f"{api.SERVER_KIND} {name}: {p}" for p in problems]
            continue
        server = api.parse_server(doc)
        refused = hostpaths.refusal(server, ours.host_path_prefixes) or (
            ours.pod_template_refusal(server)
        )
        if refused:
            errors.append(f"{api.SERVER_KIND} {name}: {refused}")
            continue
        out += render.render(server)
    return out, errors


def _cmd_render(args: argparse.Namespace) -> int:
    with open(args.file) if args.file != "-" else sys.stdin as f:
        objects, errors = render_documents(f)
    for err in errors:
        print(f"error: {err}", file=sys.stderr)
    if errors:
        return 2
    dump_yaml(objects, sys.stdout)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from . import main as operator_main  # kopf is only needed here

    return operator_main.run(namespaces=args.namespace, standalone=args.standalone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="print the Kubernetes objects for a DisaggregatedServer")
    p.add_argument("file", help="manifest with one or more DisaggregatedServers ('-' = stdin)")
    p.set_defaults(func=_cmd_render)
    p = sub.add_parser("run", help="run the operator against the cluster in KUBECONFIG")
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default all",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no peering with other operator replicas (single replica, tests)",
    )
    p.set_defaults(func=_cmd_run)
    args = parser.parse_args(argv)
    # Both commands need the operator extra (render validates with its CEL and
    # JSON-schema libraries); say so instead of dying on an import.
    absent = extras.missing(extras.OPERATOR)
    if absent:
        print(f"{parser.prog}: {extras.message(extras.OPERATOR, absent)}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
