"""Test helper: random tool schemas (JSON-schema objects) for the tool-calling tests (not a test module)."""

from __future__ import annotations

import random

WORDS = ["alpha", "bravo", "e2e4", "d2d4", "north", "south", "Paris", "Seoul", "red", "blue", "yes", "no"]
KEYS = ["city", "move", "count", "ok", "tags", "unit", "pos", "note", "depth", "when", "level", "mode"]


def _value(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "array", "object" if depth < 1 else "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "enum": rng.sample(WORDS, 3)}, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties (strings bounded, so even random weights finish a call)."""
    keys = rng.sample(KEYS, rng.randint(1, 4))
    props = {k: _value(rng, depth) for k in keys}
    return {"type": "object", "properties": props, "required": [k for k in keys if rng.random() < 0.7], "additionalProperties": False}


def random_tools(rng: random.Random, n: int | None = None) -> list[dict]:
    """1-3 function tools in OpenAI's shape with random schemas."""
    names = rng.sample(["get_weather", "make_move", "lookup", "set_alarm", "send_note", "roll_dice"], n or rng.randint(1, 3))
    return [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}", "parameters": random_schema(rng)}} for name in names]
