"""Hypothesis strategies from the JSON Schemas in our ``/openapi.json``.

Covers what those schemas use (``type`` and type lists, ``properties``/``required``,
``items``, ``enum``, ``oneOf``, numeric bounds, ``minLength``/``maxItems``); anything else
becomes arbitrary JSON, which a fuzzer wants anyway. (hypothesis-jsonschema would do this
but does not run on current Hypothesis releases.)"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "object":
        props = {k: from_schema(v) for k, v in schema.get("properties", {}).items()}
        required = [k for k in schema.get("required", []) if k in props]
        optional = {k: v for k, v in props.items() if k not in required}
        return st.fixed_dictionaries({k: props[k] for k in required}, optional=optional)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 4))  # fmt: skip
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)  # fmt: skip
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=max(40, schema.get("minLength", 0)))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON
