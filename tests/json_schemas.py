"""A JSON schema the structured-output tests hold the embedded model to: nested objects, an array
of enums, bounded strings and numbers, required fields, so that every valid answer is short."""

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
