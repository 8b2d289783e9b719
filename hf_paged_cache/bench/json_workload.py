"""A structured-outputs workload: chat requests that ask for a JSON object of a given schema.

What a JSON-extraction script or an agent sends: "give the details of X as JSON matching this schema", with
the schema in the prompt and, for a constrained request, in ``response_format`` (``json_schema``, strict), so
that the server's grammar mask holds the answer to it. The same requests without ``response_format`` measure
what the mask costs. Schemas are drawn from three shapes (a person, a book, a city), each with bounded
strings, integers with ranges, an enum, a fixed-length array, ``required`` and ``additionalProperties: false``;
the subjects' names are drawn from fixed syllables by a generator seeded with ``seed``, so the same seed
always gives the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

SYLLABLES = ("ka", "lo", "mi", "ren", "sa", "tor", "vel", "dan", "ri", "mo", "zel", "ba")


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _object({
        "name": _string(24), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": _string(24),
        "job": {"enum": ["teacher", "engineer", "farmer", "doctor", "artist"]},
        "hobbies": {"type": "array", "items": _string(16), "minItems": 3, "maxItems": 3},
    }),
    "book": _object({
        "title": _string(40), "author": _string(24), "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
        "genre": {"enum": ["novel", "poetry", "history", "science", "travel"]},
        "chapters": {"type": "array", "items": _string(24), "minItems": 4, "maxItems": 4},
    }),
    "city": _object({
        "name": _string(24), "country": _string(24),
        "population": {"type": "integer", "minimum": 1000, "maximum": 40000000},
        "climate": {"enum": ["cold", "mild", "warm", "hot"]},
        "landmarks": {"type": "array", "items": _string(24), "minItems": 3, "maxItems": 3},
    }),
}


@dataclass(frozen=True)
class JsonRequest:
    """One request: its chat messages and the schema its answer is asked to follow."""

    kind: str
    messages: tuple[dict[str, str], ...]
    schema: dict[str, Any]

    @property
    def response_format(self) -> dict[str, Any]:
        """OpenAI's ``response_format`` that holds the answer to `schema`."""
        return {"type": "json_schema", "json_schema": {"name": self.kind, "schema": self.schema, "strict": True}}


def json_workload(count: int, seed: int = 0) -> list[JsonRequest]:
    """`count` requests, request ``i`` of the ``i % 3``-th shape, each about a subject of its own."""
    rng = random.Random(seed)
    kinds = list(SCHEMAS)
    requests = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        subject = "".join(rng.choice(SYLLABLES) for _ in range(rng.randrange(2, 4))).capitalize()
        content = (f"Invent the details of a fictional {kind} called {subject}. Answer with one JSON object that "
                   f"follows this JSON schema, and nothing else:\n{json.dumps(SCHEMAS[kind])}")
        requests.append(JsonRequest(kind, ({"role": "user", "content": content},), SCHEMAS[kind]))
    return requests
