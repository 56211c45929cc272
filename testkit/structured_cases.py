"""Real-model structured-output cases: 20 (prompt, schema) pairs for SmolLM2-135M.

Every schema is *bounded* (strings have maxLength, a pattern, a format or an enum; arrays have
maxItems; numbers are finite by the grammar), so a constrained generation always ends inside
``MAX_TOKENS`` and a valid answer does not depend on the tiny model choosing to stop.
Shared by tests/test_structured_llama_cpp.py (grammar sampling through llama-cpp-python, runs
today) and tests/http/tools/test_structured.py (the same cases through the HTTP server).
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 400


def obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A closed object requiring every property (OpenAI strict-mode style)."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}


def text(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def int_range(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


PERSON = obj({"name": text(30), "age": int_range(0, 120)})

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe Alice, who is 30 years old, as JSON.", PERSON),
    ("weather", "Report the weather in Paris as JSON: 21 degrees and sunny.",
     obj({"city": text(30), "temperature_c": int_range(-50, 60),
          "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("book", "Give the title, author and year of a famous novel as JSON.",
     obj({"title": text(60), "author": text(40), "year": int_range(1800, 2025)})),
    ("todo", "List two chores as a JSON todo list.",
     obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                    "items": obj({"task": text(40), "done": {"type": "boolean"}})}})),
    ("address", "Write a postal address in the United States as JSON.",
     obj({"street": text(40), "city": text(30), "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
          "country": {"enum": ["US", "CA", "MX"]}})),
    ("product", "Describe a product with a SKU, a price and stock status as JSON.",
     obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-\d{4}$"}, "price": {"type": "number"},
          "in_stock": {"type": "boolean"}})),
    ("color", "Give the RGB values of orange as JSON.",
     obj({"r": int_range(0, 255), "g": int_range(0, 255), "b": int_range(0, 255)})),
    ("event", "Name an event and its date as JSON.",
     obj({"name": text(40), "date": {"type": "string", "format": "date"}})),
    ("sentiment", "Classify the sentiment of 'I love this phone!' as JSON.",
     obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": int_range(0, 100)})),
    ("tags", "Suggest a blog post title and some tags as JSON.",
     obj({"title": text(50), "tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                      "items": {"enum": ["python", "ai", "web", "data", "cloud"]}}})),
    ("contact", "Give a contact email and phone number as JSON.",
     obj({"email": {"type": "string", "pattern": r"^[a-z]{1,10}@[a-z]{1,10}\.com$"},
          "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}})),
    ("result", "Report whether 2 + 2 = 4 as a JSON result.",
     obj({"result": {"anyOf": [obj({"ok": {"const": True}, "value": int_range(0, 9)}),
                               obj({"ok": {"const": False}, "error": text(30)})]}})),
    ("shape", "Describe a circle of radius 5 as JSON.",
     {"oneOf": [obj({"kind": {"const": "circle"}, "radius": int_range(1, 100)}),
                obj({"kind": {"const": "square"}, "side": int_range(1, 100)})]}),
    ("team", "Describe a small team with a name and its members as JSON.",
     {"$defs": {"person": PERSON},
      **obj({"name": text(30), "members": {"type": "array", "maxItems": 3,
                                            "items": {"$ref": "#/$defs/person"}}})}),
    ("nickname", "Give a person's nickname (or null) and age as JSON.",
     obj({"nickname": {"anyOf": [text(20), {"type": "null"}]}, "age": int_range(0, 120)})),
    ("version", "Report the API version and status as JSON.",
     obj({"version": {"const": 1}, "ok": {"type": "boolean"}})),
    ("point", "Give the latitude and longitude of Paris as a JSON array.",
     {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]}),
    ("matrix", "Write a 2 by 2 matrix of digits as JSON.",
     obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                   "items": {"type": "array", "minItems": 2, "maxItems": 2,
                             "items": int_range(0, 9)}}})),
    ("recipe", "Write a pancake recipe as JSON with ingredients and grams.",
     obj({"name": text(30), "ingredients": {"type": "array", "minItems": 1, "maxItems": 4,
                                             "items": obj({"item": text(20),
                                                           "grams": int_range(1, 250)})}})),
    ("meeting", "Schedule a meeting as JSON with a title, a start time and a room code.",
     obj({"title": text(40), "start": {"type": "string", "format": "date-time"},
          "room": {"type": "string", "pattern": "^R[0-9]{2}$"}})),
]

# tool_choice cases: a tool whose arguments are bounded, and the prompt.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": obj({"city": text(30), "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone.",
    "parameters": obj({"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}/[A-Z][a-z]{1,15}$"}})}}
TOOL_PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?",
                "Is it raining in London right now?"]

# json_object allows any object, so nothing bounds a string: greedy SmolLM2 loops inside one for
# some prompts ("Describe a cat as JSON." repeats "Black, " until the length limit), exactly as
# it does without a grammar. These prompts end on their own; the grammar makes them objects.
JSON_OBJECT_PROMPTS = ["Give me a JSON object with your favourite colour.",
                       "Return JSON with keys a and b.",
                       "Return a JSON object with the name and age of a person.",
                       "Give the capital of France as a JSON object.",
                       "Describe a dog in JSON with its name and breed."]
