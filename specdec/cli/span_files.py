"""Read span files for `specdec trace-report`: this project's JSON lines or a Collector's OTLP/JSON.

Two formats, told apart line by line (a file may even mix them):
- the JSON-lines schema of orchestrator.tracing (`--trace-file`, `specdec trace-collect`): one span
  per line, an object with `span_id`;
- OTLP/JSON as the OpenTelemetry Collector's file exporter writes it: one export per line,
  `{"resourceSpans": [{"resource", "scopeSpans": [{"scope", "spans": [...]}]}]}`, trace and span
  ids as hex strings, 64-bit integers as JSON strings, enums as numbers (names are accepted too,
  and base64 ids, which is what protobuf's own JSON mapping writes).
Both become the span dicts of orchestrator.tracing.span_to_dict. Lines of other signals (a
Collector writing metrics or logs to the same file) carry no spans and are skipped; a file with
no span at all, or a line that is not JSON, is an error naming the file (and the line).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXPECTED = ("spans as JSON lines (--trace-file, specdec trace-collect) or OpenTelemetry Collector "
            "file-exporter lines (OTLP/JSON with resourceSpans)")

_KINDS = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


class SpanFileError(ValueError):
    """A span file that cannot be read; the message is one line naming the file (and line)."""


def load_spans(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every span of the files, sorted by start time; SpanFileError for a file without spans or a
    line that is not a span, an OTLP export or another JSON object."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    spans: list[dict[str, Any]] = []
    for path in paths:
        spans += _load_file(Path(path))
    spans.sort(key=lambda s: (s.get("start_ns", 0), s.get("end_ns", 0)))
    return spans


def _load_file(path: Path) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise SpanFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with handle:
        try:
            for number, line in enumerate(handle, 1):
                line = line.strip()
                if line:
                    spans += _line_spans(line, path, number)
        except UnicodeDecodeError:
            raise SpanFileError(f"{path}: not UTF-8 text; expected {EXPECTED}") from None
    if not spans:
        raise SpanFileError(f"{path}: no spans found; expected {EXPECTED}")
    return spans


def _line_spans(line: str, path: Path, number: int) -> list[dict[str, Any]]:
    where = f"{path}:{number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpanFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); "
                            f"expected {EXPECTED}") from None
    if not isinstance(data, dict):
        raise SpanFileError(f"{where}: a JSON {type(data).__name__}, not an object; expected {EXPECTED}")
    if "span_id" in data:
        return [data]
    if "resourceSpans" in data or "resource_spans" in data:
        try:
            return otlp_json_spans(data)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise SpanFileError(f"{where}: not valid OTLP/JSON: {exc}") from None
    return []  # e.g. resourceMetrics / resourceLogs of the same Collector file: no spans


# ============================================================================ OTLP/JSON


def _get(obj: Mapping[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    """OTLP/JSON uses lowerCamelCase; protobuf's JSON parser accepts the proto names too."""
    value = obj.get(camel, obj.get(snake, default))
    return default if value is None else value


def _list(obj: Mapping[str, Any], camel: str, snake: str) -> list[Any]:
    value = _get(obj, camel, snake, [])
    if not isinstance(value, list):
        raise ValueError(f"{camel} must be a list, got {type(value).__name__}")
    return value


def _id(value: Any, size: int, field: str) -> str:
    """A trace / span id as lowercase hex: OTLP/JSON writes hex, protobuf's JSON mapping base64."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {value!r}")
    if len(value) == 2 * size:
        try:
            return bytes.fromhex(value).hex()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise ValueError(f"{field} must be {2 * size} hex digits, got {value!r}")
    return raw.hex()


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{field} must be an integer (or its decimal string), got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{field} must be an integer (or its decimal string), got {value!r}") from None


def _enum(value: Any, names: Mapping[int, str], prefix: str, field: str) -> str:
    if value in (None, ""):
        return names[0]
    if isinstance(value, str) and not value.lstrip("-").isdigit():
        name = value.removeprefix(prefix)
        if name in names.values() or name == "UNSPECIFIED":
            return names[0] if name == "UNSPECIFIED" else name
        raise ValueError(f"{field}: unknown value {value!r}")
    return names.get(_int(value, field), names[0])


def any_value(value: Any) -> Any:
    """An OTLP/JSON AnyValue as a plain value (bytes stay base64, as trace-collect keeps them)."""
    if not isinstance(value, Mapping) or not value:
        return None
    if "stringValue" in value or "string_value" in value:
        return str(_get(value, "stringValue", "string_value", ""))
    if "boolValue" in value or "bool_value" in value:
        return bool(_get(value, "boolValue", "bool_value", False))
    if "intValue" in value or "int_value" in value:
        return _int(_get(value, "intValue", "int_value", 0), "intValue")
    if "doubleValue" in value or "double_value" in value:
        raw = _get(value, "doubleValue", "double_value", 0.0)
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"doubleValue must be a number, got {raw!r}")
        return float(raw)  # "NaN", "Infinity" and "-Infinity" come as strings
    if "arrayValue" in value or "array_value" in value:
        array = _get(value, "arrayValue", "array_value", {})
        return [any_value(v) for v in _list(array, "values", "values")]
    if "kvlistValue" in value or "kvlist_value" in value:
        return attributes(_list(_get(value, "kvlistValue", "kvlist_value", {}), "values", "values"))
    if "bytesValue" in value or "bytes_value" in value:
        return str(_get(value, "bytesValue", "bytes_value", ""))
    return None


def attributes(pairs: Any) -> dict[str, Any]:
    """[{"key", "value": AnyValue}, …] → {key: value}."""
    if not isinstance(pairs, list):
        raise ValueError(f"attributes must be a list, got {type(pairs).__name__}")
    return {str(kv["key"]): any_value(kv.get("value")) for kv in pairs}


def otlp_json_spans(export: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every span of one OTLP/JSON ExportTraceServiceRequest in the schema of orchestrator.tracing."""
    spans = []
    for resource_spans in _list(export, "resourceSpans", "resource_spans"):
        resource = attributes(_get(_get(resource_spans, "resource", "resource", {}), "attributes",
                                   "attributes", []))
        service = str(resource.get("service.name", ""))
        for scope_spans in _list(resource_spans, "scopeSpans", "scope_spans"):
            scope = str(_get(_get(scope_spans, "scope", "scope", {}), "name", "name", ""))
            for span in _list(scope_spans, "spans", "spans"):
                status = _get(span, "status", "status", {})
                span_id = _id(_get(span, "spanId", "span_id"), 8, "spanId")
                if not span_id:
                    raise ValueError("a span without spanId")
                parent = _id(_get(span, "parentSpanId", "parent_span_id"), 8, "parentSpanId")
                spans.append({
                    "trace_id": _id(_get(span, "traceId", "trace_id"), 16, "traceId"),
                    "span_id": span_id,
                    "parent_span_id": parent or None,
                    "name": str(_get(span, "name", "name", "")),
                    "kind": _enum(_get(span, "kind", "kind"), _KINDS, "SPAN_KIND_", "kind"),
                    "start_ns": _int(_get(span, "startTimeUnixNano", "start_time_unix_nano", 0),
                                     "startTimeUnixNano"),
                    "end_ns": _int(_get(span, "endTimeUnixNano", "end_time_unix_nano", 0), "endTimeUnixNano"),
                    "status": _enum(_get(status, "code", "code"), _STATUS, "STATUS_CODE_", "status.code"),
                    "status_message": str(_get(status, "message", "message", "")),
                    "attributes": attributes(_get(span, "attributes", "attributes", [])),
                    "events": [{"name": str(_get(e, "name", "name", "")),
                                "time_ns": _int(_get(e, "timeUnixNano", "time_unix_nano", 0), "timeUnixNano"),
                                "attributes": attributes(_get(e, "attributes", "attributes", []))}
                               for e in _list(span, "events", "events")],
                    "service": service,
                    "resource": resource,
                    "scope": scope,
                })
    return spans
