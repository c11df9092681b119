"""The requests of `keras-transformer-serve`: their fields, checks and schema.

The search options a request may set are `options.SearchOptions`'s own (`options.option_fields`):
the JSON fields, their checks and the OpenAPI schema are made from them, as
the translate commands' flags are. Every refusal names the field.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from keras_transformer_runtime.documents import INPUT_FORMATS, check_terms
from keras_transformer_runtime.options import SearchOptions, option_fields


class Refusal(Exception):
    """A request refused with an HTTP `status` and a message for the client."""

    def __init__(self, status, message, headers=None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


# The fields of a request besides the search options, with their help.
_TEXT_FIELDS = (
    (
        "texts",
        list[str],
        "sentences to translate, one translation each, in order; an empty string "
        "translates to an empty string",
    ),
    (
        "prefixes",
        list[str] | None,
        'target prefixes, one per text ("" for none): each translation starts with its prefix',
    ),
    (
        "constraints",
        list[list[str] | None] | None,
        "one entry per text: target phrases its translation must hold "
        "(docs/constraints.md), or null or [] for none",
    ),
    (
        "format",
        str,
        "text: each text is one input (default); paragraphs: each text is a document, "
        "split into sentences whose translations take their places, every line break "
        "and space kept; html: each text is a page, its text translated in context and "
        "its inline tags put back around the aligned words; markdown: the same for "
        "Markdown (docs/documents.md)",
    ),
    (
        "source_language",
        str | None,
        "the language whose rules split documents into sentences (default: the "
        "export's source_language, else en)",
    ),
    (
        "terms",
        list[list[str]] | None,
        "a glossary of [source term, target phrase] pairs: each sentence that holds a "
        "source term (a whole word, any case) must hold its target phrase",
    ),
    ("suppress", list[str] | None, "words or phrases never generated (their tokens in a row)"),
    (
        "return_scores",
        bool,
        "also answer each translation's score (greedy: summed log-probability; beam: "
        "length-penalized)",
    ),
    ("max_decoding_length", int | None, "another name of max_length"),
)
OPTION_FIELDS = {field.name: field for field in option_fields()}


def _request_model():
    """The request as a msgspec struct: the text fields, then every search option
    of `options.option_fields` (its type, or null for its default), with its help."""
    fields = []
    for name, kind, help in _TEXT_FIELDS:
        annotated = Annotated[kind, msgspec.Meta(description=help)]
        if name == "texts":
            fields.append((name, annotated))
        elif name == "format":
            fields.append((name, annotated, "text"))
        else:
            fields.append((name, annotated, False if kind is bool else None))
    for name, field in OPTION_FIELDS.items():
        description = field.help + ("" if field.optional else f" (default {field.default})")
        fields.append(
            (name, Annotated[field.kind | None, msgspec.Meta(description=description)], None)
        )
    return msgspec.defstruct("TranslateRequest", fields, forbid_unknown_fields=True)


TranslateRequest = _request_model()
REQUEST_FIELDS = TranslateRequest.__struct_fields__
_KINDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}


def _kind(names):
    """msgspec's type names ("int | null") as the message says them ("an integer")."""
    kinds = [_KINDS.get(name.strip(" `"), name.strip(" `")) for name in names.split("|")]
    return " or ".join(kind for kind in kinds if kind != "null") or "null"


def _refusal(error):
    """msgspec's `ValidationError` as a 400 that names the field as a client sent it."""
    message = str(error)
    if message.startswith("Object contains unknown field"):
        unknown = message.split("`")[1]
        return Refusal(
            400, f"unknown field(s) {unknown!r}; the fields are {', '.join(REQUEST_FIELDS)}"
        )
    if message.startswith("Object missing required field") or message.endswith(
        "got `null` - at `$.texts`"
    ):
        return Refusal(400, 'the field "texts" (a list of strings) is missing or null')
    expected, got, where = message.partition(" - at `$")[0], message, ""
    if " - at `$" in message:
        where = message.split(" - at `$", 1)[1].rstrip("`").lstrip(".")
    if expected.startswith("Expected `") and ", got `" in expected:
        want, have = expected[len("Expected `") :].split("`, got `")
        got = f"{_kind(want)}, not {_kind(have.rstrip('`'))}"
        if not where:
            return Refusal(400, f"the body must be a JSON object, not {_kind(have.rstrip('`'))}")
        name, _, index = where.partition("[")
        field = f'"{name}"' + (f"[{index}" if index else "")
        return Refusal(400, f"{field} must be {got}")
    return Refusal(400, f"{message} (at {where or 'the body'})")


def parse_request(data, settings, tokenizer):
    """The checked fields of a decoded JSON body:
    `(texts, prefixes, constraints, options, return_scores, (format, source_language,
    terms))`.

    The types are `TranslateRequest`'s (msgspec); then the counts, sizes and
    values. `options` is a `options.SearchOptions`; `prefixes` is None or one
    text per text; `constraints` None or per text a list of phrases (or None).
    Raises `Refusal` 400 for a wrong shape, type or value, 413 for too many
    texts or characters; each message names the field.
    """
    try:
        request = msgspec.convert(data, TranslateRequest)
    except msgspec.ValidationError as error:
        raise _refusal(error) from None
    texts, prefixes, constraints = request.texts, request.prefixes, request.constraints
    if len(texts) > settings.max_texts:
        raise Refusal(
            413,
            f"{len(texts)} texts in one request; this server takes at most "
            f"{settings.max_texts} (--max-texts): split the request",
        )
    if prefixes is not None and len(prefixes) != len(texts):
        raise Refusal(
            400, f'{len(prefixes)} "prefixes" for {len(texts)} texts: give one each ("" for none)'
        )
    if constraints is not None and len(constraints) != len(texts):
        raise Refusal(
            400,
            '"constraints" must be a list with one entry per text: a list of target '
            "phrases, or null or [] for none",
        )
    if request.format not in INPUT_FORMATS:
        raise Refusal(
            400,
            f'"format" must be one of {", ".join(INPUT_FORMATS)}. Received: {request.format!r}',
        )
    if request.format != "text":
        sentence_fields = (
            ("prefixes", prefixes is not None),
            ("constraints", constraints is not None),
            ("return_scores", request.return_scores),
            ("n_best", (request.n_best or 1) > 1),
            ("token_scores", request.token_scores),
            ("alignment", request.alignment),
        )
        for name, given in sentence_fields:
            if given:
                raise Refusal(
                    400,
                    f'"{name}" is for sentences ("format": "text"); "format": '
                    f'"{request.format}" translates each text as a document',
                )
    terms = None
    if request.terms is not None:
        if constraints is not None:
            raise Refusal(400, 'give "constraints" or "terms", not both')
        try:
            terms = check_terms(request.terms)
        except ValueError as error:
            raise Refusal(400, f'"terms": {error}') from None
    suppress = request.suppress or []
    phrases = [p for entry in constraints or () for p in entry or ()]
    phrases += [p for pair in terms or () for p in pair]
    chars = sum(map(len, texts)) + sum(map(len, prefixes or ())) + sum(map(len, suppress))
    chars += sum(map(len, phrases))
    if chars > settings.max_chars:
        raise Refusal(
            413,
            f"{chars} characters in one request; this server takes at most "
            f"{settings.max_chars} (--max-chars): split the request",
        )
    values = {name: getattr(request, name) for name in OPTION_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if request.max_decoding_length is not None:
        if "max_length" in values:
            raise Refusal(
                400, 'give "max_length" or its other name "max_decoding_length", not both'
            )
        values["max_length"] = request.max_decoding_length
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise Refusal(400, f'"{name}" must be a finite number. Received: {value}')
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
    sequences = []
    for text in suppress:
        ids = tokenizer.encode_target(text)
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
    document = (request.format, request.source_language, terms)
    return texts, prefixes, constraints, options, request.return_scores, document


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

    (request,), components = msgspec.json.schema_components([TranslateRequest])
    request = components["TranslateRequest"]
    described = request["properties"]
    described["texts"]["maxItems"] = settings.max_texts
    described["texts"]["description"] += f"; at most {settings.max_chars} characters in all"
    for name, field in OPTION_FIELDS.items():
        if not field.optional:
            described[name]["default"] = field.default
    described["beam_size"]["maximum"] = settings.max_beam_size
    described["max_length"]["maximum"] = settings.max_decoding_length
    described["format"]["enum"] = list(INPUT_FORMATS)
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
