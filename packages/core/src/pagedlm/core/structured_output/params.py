"""``StructuredOutputsParams``: what a request's output must match (vLLM's names and fields).

Exactly one constraint per request: ``json`` (a JSON Schema, as a dict, a JSON string or a
pydantic model class), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF, in the
GBNF dialect xgrammar reads), ``json_object=True`` (any JSON object) or ``structural_tag`` (an
xgrammar structural tag, as a JSON string). Checks that need no grammar engine run here; the
backend checks that the schema, regex or grammar compiles when the request enters the engine.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

#: the constraint fields, in the order their kind names them (``StructuredOutputsParams.kind``)
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    #: vLLM's per-request knobs of the JSON grammar
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type):  # a pydantic model class, as vLLM accepts
            schema_of = getattr(self.json, "model_json_schema", None)
            if schema_of is None:
                raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON Schema (dict or JSON "
                                 "string) or a pydantic model class")
            self.json = schema_of()
        if self.json_object is False:
            self.json_object = None
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                f"got {', '.join(given) if given else 'none'}")
        self._verify(given[0])

    def _verify(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(parsed).__name__}")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"structured_outputs.choice={value!r} is invalid: must be a non-empty list of "
                                 "strings")
            if any(not isinstance(c, str) or not c for c in value):
                raise ValueError(f"structured_outputs.choice={value!r} is invalid: every choice must be a "
                                 "non-empty string")
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object={value!r} must be true")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind}={value!r} is invalid: must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of :data:`CONSTRAINT_FIELDS`."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def spec(self) -> str:
        """The constraint as one string: with :attr:`kind`, the key of the compiled-grammar cache."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
            return f"{text}\x00{self.disable_any_whitespace}\x00{self.disable_additional_properties}"
        if kind == "choice":
            return _json.dumps(value)
        if kind == "json_object":
            return f"{self.disable_any_whitespace}"
        return value

    @classmethod
    def from_guided(cls, *, guided_json: Any = None, guided_regex: str | None = None,
                    guided_choice: list[str] | None = None, guided_grammar: str | None = None,
                    guided_json_object: bool | None = None,
                    guided_whitespace_pattern: str | None = None) -> StructuredOutputsParams | None:
        """The older ``guided_*`` fields (vLLM < 0.11) as params; None when none is given."""
        fields = {"json": guided_json, "regex": guided_regex, "choice": guided_choice, "grammar": guided_grammar,
                  "json_object": guided_json_object or None}
        if all(v is None for v in fields.values()):
            return None
        return cls(**fields, whitespace_pattern=guided_whitespace_pattern)

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        params = object.__new__(cls)  # already verified by the front end
        params.__dict__.update(fields)
        return params
