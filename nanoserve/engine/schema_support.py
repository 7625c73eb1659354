"""JSON Schema keywords that xgrammar accepts and then does not enforce.

xgrammar compiles a schema with these keywords without an error (at most a warning on stderr) and
leaves them out of the grammar, so the output could break the schema it was asked to keep: an
`uniqueItems` array came back as [1, 1, 1], an `allOf` of a string and an integer as -1.0, a
`required` property that the schema does not declare was left out, a `$ref` to another document (or
to an anchor) held the value to nothing. A schema that uses one is
refused instead, naming the keyword and where it is, as vLLM refuses them for xgrammar.
"""

from __future__ import annotations

from typing import Any

# never enforced, wherever they are
_IGNORED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
            "dependentRequired", "dependentSchemas")
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# keys whose value is one subschema, a list of them, or a map from names to them (a property may be
# called "enum" or "$ref" and still be a schema)
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def unenforced_keyword(schema: Any) -> str | None:
    """Why xgrammar would not hold an output to `schema` (the first keyword found, and where), or
    None. Walked with a stack: a schema may nest as deep as a request body may."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        why = _unenforced_here(node)
        if why is not None:
            return f"{why} (at {at})"
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{at}/{key}"))
        for key in _MANY:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{at}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in NAMED_SCHEMAS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{at}/{key}/{name}") for name, sub in node[key].items())
    return None


def _unenforced_here(node: dict) -> str | None:
    for key in _IGNORED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return f"'{key}' is not enforced"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema is not enforced"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"'$ref' {ref[:80]!r} is not resolved: only references into the schema itself ('#/...') are"
    if node.get("type") == []:
        return "'type' lists no type, so nothing could match"
    if "multipleOf" in node and any(key in node for key in _RANGE):
        return "'multipleOf' beside a range is not enforced"
    # xgrammar requires only declared properties, whatever additionalProperties allows
    required, properties = node.get("required"), node.get("properties") or {}
    if isinstance(required, list) and isinstance(properties, dict):
        missing = [name for name in required if name not in properties]
        if missing:
            return f"'required' names {str(missing[0])[:80]!r}, which 'properties' does not declare"
    return None
