"""Twenty JSON schemas of the kinds users send: nested objects, arrays with
min/max items, enums, bounded numbers, optional fields, additionalProperties
false, unions, $defs references."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }
    if closed:
        schema["additionalProperties"] = False
    return schema


# Every value bounded (strings, numbers, arrays, extra properties): a weak model
# at temperature 1 can otherwise emit digits or characters until max_tokens,
# which no grammar engine can turn into a complete reply.
NAME = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a person.", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}})),
    (
        "city",
        "Describe a city.",
        _obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000}}),
    ),
    ("colors", "List some colors.", _obj({"colors": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}})),
    ("sentiment", "Is 'I love it' positive?", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    (
        "score",
        "Rate a movie.",
        _obj(
            {"title": NAME, "stars": {"type": "number", "minimum": 0, "maximum": 5}, "recommended": {"type": "boolean"}}
        ),
    ),
    (
        "optional",
        "Describe a book.",
        _obj(
            {"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 0, "maximum": 2100}},
            required=["title"],
        ),
    ),
    (
        "nested",
        "Describe a company and its CEO.",
        _obj({"company": NAME, "ceo": _obj({"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 100}})}),
    ),
    (
        "order",
        "Write a pizza order.",
        _obj(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "pizza": NAME,
                            "size": {"enum": ["S", "M", "L"]},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                        }
                    ),
                },
                "delivery": {"type": "boolean"},
            }
        ),
    ),
    (
        "point",
        "Give a point on a grid.",
        _obj(
            {
                "x": {"type": "integer", "minimum": -10, "maximum": 10},
                "y": {"type": "integer", "minimum": -10, "maximum": 10},
            }
        ),
    ),
    (
        "nullable",
        "Describe a pet, if any.",
        _obj(
            {
                "pet": {"type": ["string", "null"], "maxLength": 20},
                "count": {"type": "integer", "minimum": 0, "maximum": 9},
            }
        ),
    ),
    ("const", "Say hello as JSON.", _obj({"greeting": {"const": "hello"}, "to": NAME})),
    (
        "tags",
        "Tag a blog post.",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["tech", "food", "travel", "art"]},
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    (
        "matrix",
        "Give a 2x2 matrix.",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            }
        ),
    ),
    (
        "defs",
        "Describe two people.",
        {
            "$defs": {"p": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})},
            "type": "object",
            "properties": {"first": {"$ref": "#/$defs/p"}, "second": {"$ref": "#/$defs/p"}},
            "required": ["first", "second"],
            "additionalProperties": False,
        },
    ),
    (
        "union",
        "Give an id.",
        _obj(
            {
                "id": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 999_999},
                        {"type": "string", "maxLength": 12},
                    ]
                }
            }
        ),
    ),
    ("pattern", "Give a US zip code.", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    (
        "open",  # extra properties allowed, but bounded: an unbounded object may not end before max_tokens at T=1
        "Describe a car.",
        {
            **_obj({"make": NAME, "model": NAME}, closed=False),
            "maxProperties": 4,
            "patternProperties": {"^[a-z_]{1,20}$": NAME},
            "additionalProperties": False,
        },
    ),
    (
        "array_root",
        "List three numbers.",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 3},
    ),
    (
        "weather",
        "Report the weather.",
        _obj(
            {
                "temp_c": {"type": "number", "minimum": -60, "maximum": 60},
                "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
                "wind": _obj({"kph": {"type": "integer", "minimum": 0, "maximum": 200}}),
            }
        ),
    ),
    (
        "event",
        "Describe an event.",
        _obj(
            {
                "name": NAME,
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "guests": {"type": "array", "items": NAME, "maxItems": 3},
            },
            required=["name", "day", "month"],
        ),
    ),
]
