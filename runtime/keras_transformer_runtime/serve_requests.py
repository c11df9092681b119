"""The requests of `keras-transformer-serve`: their fields, checks and schema.

The search options a request may set are `options.SearchOptions`'s own (`options.option_fields`):
the JSON fields, their checks and the OpenAPI schema are made from them, as
the translate commands' flags are. Every refusal names the field.
"""

from __future__ import annotations

import json
import math

from keras_transformer_runtime.options import SearchOptions, option_fields


class Refusal(Exception):
    """A request refused with an HTTP `status` and a message for the client."""

    def __init__(self, status, message, headers=None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The search options a request may set, each a JSON field of the option's
# name, type, default and help (`options.option_fields`): the translate
# commands' flags come from the same definitions (docs/decoding.md).
_CHECKS = {
    int: (_is_int, "an integer"),
    float: (_is_number, "a number"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
}
OPTION_FIELDS = {field.name: field for field in option_fields()}
OPTION_TYPES = {name: _CHECKS[field.kind] for name, field in OPTION_FIELDS.items()}
REQUEST_FIELDS = (
    "texts",
    "prefixes",
    "constraints",
    *OPTION_TYPES,
    "max_decoding_length",
    "suppress",
    "return_scores",
)


def _strings(data, name, required=False):
    value = data.get(name)
    if value is None:
        if required:
            raise Refusal(400, f'the field "{name}" (a list of strings) is missing or null')
        return None
    if not isinstance(value, list):
        raise Refusal(400, f'"{name}" must be a list of strings, not {_json_type(value)}')
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise Refusal(400, f'"{name}"[{i}] must be a string, not {_json_type(item)}')
    return value


def parse_request(data, settings, tokenizer):
    """The checked fields of a decoded JSON body:
    `(texts, prefixes, constraints, options, return_scores)`.

    `options` is a `options.SearchOptions`; `prefixes` is None or one text per
    text; `constraints` None or per text a list of phrases (or None). Raises `Refusal` 400 for a wrong shape, type or value, 413 for too
    many texts or characters.
    """
    if not isinstance(data, dict):
        raise Refusal(400, f"the body must be a JSON object, not {_json_type(data)}")
    unknown = sorted(set(data) - set(REQUEST_FIELDS))
    if unknown:
        raise Refusal(
            400,
            f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
            f"{', '.join(REQUEST_FIELDS)}",
        )
    texts = _strings(data, "texts", required=True)
    if len(texts) > settings.max_texts:
        raise Refusal(
            413,
            f"{len(texts)} texts in one request; this server takes at most "
            f"{settings.max_texts} (--max-texts): split the request",
        )
    prefixes = _strings(data, "prefixes")
    if prefixes is not None and len(prefixes) != len(texts):
        raise Refusal(
            400, f'{len(prefixes)} "prefixes" for {len(texts)} texts: give one each ("" for none)'
        )
    suppress = _strings(data, "suppress") or []
    constraints = data.get("constraints")
    if constraints is not None:
        if not isinstance(constraints, list) or len(constraints) != len(texts):
            raise Refusal(
                400,
                '"constraints" must be a list with one entry per text: a list of target '
                "phrases, or null or [] for none",
            )
        for i, entry in enumerate(constraints):
            if entry is not None and (
                not isinstance(entry, list) or not all(isinstance(p, str) for p in entry)
            ):
                raise Refusal(400, f'"constraints"[{i}] must be a list of strings or null')
    phrases = [p for entry in constraints or () for p in entry or ()]
    chars = sum(map(len, texts)) + sum(map(len, prefixes or ())) + sum(map(len, suppress))
    chars += sum(map(len, phrases))
    if chars > settings.max_chars:
        raise Refusal(
            413,
            f"{chars} characters in one request; this server takes at most "
            f"{settings.max_chars} (--max-chars): split the request",
        )
    if "max_decoding_length" in data:
        if "max_length" in data:
            raise Refusal(
                400, 'give "max_length" or its other name "max_decoding_length", not both'
            )
        data = dict(data, max_length=data["max_decoding_length"])
    values = {}
    for name, (check, kind) in OPTION_TYPES.items():
        value = data.get(name)
        if value is None:
            continue
        if not check(value) or (_is_number(value) and not math.isfinite(value)):
            raise Refusal(400, f'"{name}" must be {kind}. Received: {json.dumps(value)}')
        values[name] = value
    beam_size = values.get("beam_size", OPTION_FIELDS["beam_size"].default)
    if not 1 <= beam_size <= settings.max_beam_size:
        raise Refusal(
            400,
            f'"beam_size" must be an integer from 1 (greedy) to {settings.max_beam_size}. '
            f"Received: {beam_size}",
        )
    max_length = values.get("max_length")
    if max_length is not None and not 1 <= max_length <= settings.max_decoding_length:
        raise Refusal(
            400,
            f'"max_length" must be an integer from 1 to {settings.max_decoding_length} '
            f"(or null: the source length + 50). Received: {max_length}",
        )
    return_scores = data.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise Refusal(
            400, f'"return_scores" must be true or false. Received: {json.dumps(return_scores)}'
        )
    sequences = []
    for text in suppress:
        ids = tokenizer.encode(text)
        if not ids:
            raise Refusal(400, f'"suppress" holds {text!r}, which has no tokens')
        sequences.append(ids)
    if beam_size == 1:
        # Greedy search has no length penalty: greedy requests share batches whatever they say.
        values.pop("length_penalty", None)
    try:
        options = SearchOptions(suppress_sequences=sequences, **values)
    except ValueError as error:
        raise Refusal(400, str(error)) from None
    return texts, prefixes, constraints, options, return_scores


def _json_type(value):
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def decode_body(body):
    """The JSON text of `body`, and a warning when it was not valid UTF-8.

    As `keras-transformer-translate` reads its input: undecodable bytes read
    as U+FFFD, the request is translated, and the answer says so.
    """
    try:
        return body.decode("utf-8"), None
    except UnicodeDecodeError:
        return body.decode("utf-8", errors="replace"), (
            "the request body is not valid UTF-8; its undecodable bytes read as U+FFFD"
        )


def clean_texts(texts):
    """`texts` with lone surrogates (JSON escapes such as \\ud800) as U+FFFD, and their indices."""
    replaced = []
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            texts[i] = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            replaced.append(i)
    return replaced


def openapi_schema(settings):
    """The OpenAPI 3.1 document of the server's endpoints (`GET /openapi.json`)."""
    error = {
        "type": "object",
        "properties": {"error": {"type": "string", "description": "what was wrong"}},
        "required": ["error"],
    }

    def error_response(description):
        return {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    request = {
        "type": "object",
        "required": ["texts"],
        "additionalProperties": False,
        "properties": {
            "texts": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": settings.max_texts,
                "description": "sentences to translate, one translation each, in order; an "
                f"empty string translates to an empty string; at most {settings.max_chars} "
                "characters in all",
            },
            "prefixes": {
                "type": "array",
                "items": {"type": "string"},
                "description": 'target prefixes, one per text ("" for none): each '
                "translation starts with its prefix",
            },
            "constraints": {
                "type": "array",
                "items": {"type": ["array", "null"], "items": {"type": "string"}},
                "description": "one entry per text: target phrases its translation must hold "
                "(docs/constraints.md), or null or [] for none",
            },
            "suppress": {
                "type": "array",
                "items": {"type": "string"},
                "description": "words or phrases never generated (their tokens in a row)",
            },
            "return_scores": {
                "type": "boolean",
                "default": False,
                "description": "also answer each translation's score (greedy: summed "
                "log-probability; beam: length-penalized)",
            },
            "max_decoding_length": {
                "type": ["integer", "null"],
                "description": "another name of max_length",
            },
        },
    }
    described = request["properties"]
    kinds = {int: "integer", float: "number", bool: "boolean"}
    for name, field in OPTION_FIELDS.items():
        entry = {"type": kinds[field.kind], "description": field.help}
        if field.optional:
            entry["type"] = [entry["type"], "null"]
        else:
            entry["default"] = field.default
        described.setdefault(name, entry)
    described["beam_size"]["maximum"] = settings.max_beam_size
    described["max_length"]["maximum"] = settings.max_decoding_length
    response = {
        "type": "object",
        "required": ["translations"],
        "properties": {
            "translations": {"type": "array", "items": {"type": "string"}},
            "scores": {"type": "array", "items": {"type": "number"}},
            "hypotheses": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "object"}},
                "description": "with n_best > 1, token_scores or alignment: per text its "
                "hypotheses, best first, each {text, score, log_prob[, token_scores][, alignment]}",
            },
            "warnings": {
                "type": "array",
                "items": {"type": "string"},
                "description": "input that was translated but not as sent (invalid UTF-8, "
                "texts longer than the model's max_length)",
            },
        },
    }
    json_body = {"content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "keras-transformer-serve", "version": "1"},
        "paths": {
            "/translate": {
                "post": {
                    "summary": "Translate texts; concurrent requests are batched together",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/TranslateRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "the translations, in input order",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/TranslateResponse"}
                                }
                            },
                        },
                        "400": error_response("malformed JSON, a wrong type or value"),
                        "413": error_response("too many texts or characters"),
                        "503": error_response("the queue is full; see Retry-After"),
                        "504": error_response("not translated within --request-timeout"),
                    },
                }
            },
            "/health": {"get": {"summary": "The process is up", "responses": {"200": json_body}}},
            "/ready": {
                "get": {
                    "summary": "The model is loaded and the queue has room",
                    "responses": {"200": json_body, "503": error_response("the queue is full")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus text exposition",
                    "responses": {"200": {"content": {"text/plain": {}}}},
                }
            },
        },
        "components": {
            "schemas": {
                "TranslateRequest": request,
                "TranslateResponse": response,
                "Error": error,
            }
        },
    }
