"""Check a manifest against the CRD schema without a cluster.

The same rules the API server enforces: the structural OpenAPI schema (types,
enums, bounds, patterns, required fields, unknown fields as under kubectl's
strict field validation) and the CEL ``x-kubernetes-validations`` rules,
evaluated on the defaulted object. Used by ``kvferry-operator render`` so an
offline render fails with the message ``kubectl apply`` would print, and by the
tests that pin every rule's message.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from . import api


@dataclass(frozen=True)
class FieldError:
    path: str  # e.g. spec.prefill.resources.gpus
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def _to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """Translate a Kubernetes structural schema node into JSON Schema draft 4."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "format"):
            continue
        if key == "pattern":
            out[key] = _go_pattern(value)
        elif key == "properties":
            out[key] = {k: _to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _to_jsonschema(value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator(kind: str) -> jsonschema.Draft4Validator:
    schema = _to_jsonschema(api.openapi_schema(kind))
    # metadata is validated by the API server's own rules, not the CRD's.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


class _MapKey(str):
    """A key of a map (additionalProperties): the API server writes it ``[key]``."""


def _path(parts: list[Any] | tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        bracket = isinstance(part, int | _MapKey)
        out += f"[{part}]" if bracket else f".{part}" if out else str(part)
    return out


def _json_type(value: Any) -> str:
    for name, kind in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if isinstance(value, kind):
            return name
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "null"


def _quote(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def _describe(err: jsonschema.ValidationError, where: str) -> str:
    """The API server's wording, so one expected message fits both checks."""
    v, arg, got = err.validator, err.validator_value, err.instance
    if v == "enum":
        supported = ", ".join(_quote(x) for x in arg)
        msg = f"Unsupported value: {_quote(got)}: supported values: {supported}"
        if isinstance(got, bool):
            # YAML 1.1 reads unquoted Off/On/Yes/No as booleans.
            msg += " (an unquoted Off/On/Yes/No is read as a boolean: quote it)"
        return msg
    if v == "type":
        msg = f"Invalid value: {_quote(_json_type(got))}: {where} in body must be of type {arg}"
        if isinstance(got, bool) and arg == "string":
            msg += " (an unquoted Off/On/Yes/No is read as a boolean: quote it)"
        return msg
    if v == "minimum":
        if err.schema.get("exclusiveMinimum"):
            return f"Invalid value: {got}: {where} in body should be greater than {arg}"
        return f"Invalid value: {got}: {where} in body should be greater than or equal to {arg}"
    if v == "maximum":
        return f"Invalid value: {got}: {where} in body should be less than or equal to {arg}"
    if v == "pattern":
        arg = arg[:-2] + "$" if arg.endswith(r"\Z") else arg  # as the CRD writes it
        return f"Invalid value: {_quote(got)}: {where} in body should match '{arg}'"
    if v == "maxProperties":
        items = "1 item" if arg == 1 else f"{arg} items"
        return f"Too many: {len(got)}: must have at most {items}"
    if v == "minItems":
        return f"Invalid value: {len(got)}: {where} in body should have at least {arg} items"
    if v == "minLength":
        return f"Invalid value: {_quote(got)}: {where} in body should be at least {arg} chars long"
    if v == "maxLength":
        return f"Too long: may not be more than {arg} bytes"
    return err.message


# The API server's error types that stop it from running the CEL rules (its
# hasBlockingErr: NotSupported, Required, TooLong, TooMany, TypeInvalid), by the JSON
# Schema keyword that reports them here. Any other schema error (a bound, a pattern, a
# duplicate) is reported together with the CEL rules' errors.
_BLOCKING = {"enum", "required", "maxLength", "maxItems", "maxProperties", "type", "anyOf"}


@dataclass(frozen=True)
class _SchemaError(FieldError):
    blocking: bool = False
    unknown: bool = False


def _schema_errors(kind: str, obj: dict[str, Any]) -> list[_SchemaError]:
    errors: list[_SchemaError] = []
    for err in _validator(kind).iter_errors(obj):
        blocking = err.validator in _BLOCKING
        path = list(err.absolute_path)
        if err.validator == "required":
            missing = err.message.split("'")[1]
            errors.append(_SchemaError(_path([*path, missing]), "Required value", True))
        elif err.validator == "additionalProperties":
            for extra in sorted(set(err.instance) - set(err.schema.get("properties", {}))):
                where = _path([*path, extra])
                errors.append(_SchemaError(where, f'unknown field "{where}"', unknown=True))
        elif err.validator == "anyOf" and err.schema.get("anyOf", [{}])[0] == {"type": "integer"}:
            where = _path(path)
            errors.append(
                _SchemaError(
                    where,
                    f"Invalid value: {_quote(err.instance)}: "
                    f"{where} in body must be of type integer or string",
                    True,
                )
            )
        else:
            errors.append(_SchemaError(_path(path), _describe(err, _path(path)), blocking))
    # Like the API server, a value of the wrong type gets only that complaint.
    mistyped = {e.path for e in errors if "must be of type" in e.message}
    errors = [e for e in errors if e.path not in mistyped or "must be of type" in e.message]
    return sorted(errors, key=lambda e: e.path)


def _duplicates(schema: dict[str, Any], value: Any, path: list[Any]) -> list[_SchemaError]:
    """x-kubernetes-list-type map and set: each key (set: each item) once, as the API
    server checks them (jsonschema has no list types)."""
    errors: list[_SchemaError] = []
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += _duplicates(sub, value[name], [*path, name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        kind, keys = schema.get("x-kubernetes-list-type"), schema.get("x-kubernetes-list-map-keys")
        seen: set[str] = set()
        for i, item in enumerate(value):
            if kind == "map" and isinstance(item, dict):
                key = {k: item[k] for k in keys or [] if k in item}
            elif kind == "set":
                key = item
            else:
                key = None
            if key is not None:
                text = json.dumps(key, sort_keys=True, separators=(",", ":"))
                if text in seen:
                    errors.append(_SchemaError(_path([*path, i]), f"Duplicate value: {text}"))
                seen.add(text)
            errors += _duplicates(schema["items"], item, [*path, i])
    return errors


@functools.cache
def _cel_program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions={"matches": _go_matches})


def _go_pattern(pattern: str) -> str:
    """Go's regexp (the API server's) matches a final $ only at the very end of the
    text; Python's also before a final newline, so "1Gi\n" would pass here and fail
    there."""
    return (
        pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    )


def _go_matches(text: Any, pattern: Any) -> celtypes.BoolType:
    """CEL's string.matches as the API server runs it (see _go_pattern)."""
    return celtypes.BoolType(re.search(_go_pattern(str(pattern)), str(text)) is not None)


def _cel_errors(schema: dict[str, Any], value: Any, path: list[Any]) -> list[FieldError]:
    errors: list[FieldError] = []
    for check in schema.get("x-kubernetes-validations", []):
        where = _path(path) + check.get("fieldPath", "")
        try:
            ok = _cel_program(check["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as exc:  # a rule that cannot evaluate is a bug in our CRD
            errors.append(FieldError(where, f"rule {check['rule']!r} failed to evaluate: {exc}"))
            continue
        if not bool(ok):
            errors.append(FieldError(where, " ".join(check["message"].split())))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name in value:
                errors += _cel_errors(sub, value[name], [*path, name])
        # A map's values carry rules too (resources.limits: each a quantity), which
        # the API server runs on every entry.
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in props:
                    errors += _cel_errors(extra, item, [*path, _MapKey(name)])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, [*path, i])
    return errors


def prune_nulls(obj: Any, kind: str = api.SERVER_KIND) -> Any:
    """``obj`` without the nulls the API server drops before it validates: a null for
    a field that is not nullable (every field here), a property's or a map entry's
    (``podLabels: {a: null}`` is stored as ``{}``). A null list item stays (refused)."""
    return _prune(api.openapi_schema(kind), copy.deepcopy(obj))


def _prune(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and not schema.get("nullable"):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name in list(value):
            sub = props.get(name, extra if isinstance(extra, dict) else None)
            if value[name] is None and sub is not None and not sub.get("nullable"):
                del value[name]
            elif sub is not None:
                value[name] = _prune(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(schema["items"], item) for item in value]
    return value


def validate(obj: dict[str, Any], kind: str = api.SERVER_KIND) -> list[FieldError]:
    """All the reasons the API server would reject ``obj``; empty when it is valid."""
    obj = prune_nulls(obj, kind)
    errors = _schema_errors(kind, obj)
    unknown = [e for e in errors if e.unknown]
    if unknown:
        # Strict field validation refuses unknown fields when it decodes the object,
        # before anything else is checked.
        return [FieldError(e.path, e.message) for e in unknown]
    schema = api.openapi_schema(kind)
    errors += sorted(_duplicates(schema, obj, []), key=lambda e: e.path)
    out = [FieldError(e.path, e.message) for e in errors]
    if any(e.blocking for e in errors):
        # As the API server: no CEL rule runs on an object of the wrong shape.
        return out
    return out + _cel_errors(schema, api.apply_defaults(schema, obj), [])
