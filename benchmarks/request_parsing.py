"""One-off: the cost per request of the server's request checks, three ways.

    python -m benchmarks.request_parsing

The hand-written checks of 51c75e0 (json.loads + parse_request, SearchOptions
made), msgspec.convert and pydantic's model_validate of the same request model
(generated from `options.option_fields`), each after json.loads, on a
one-sentence request and a 32-sentence one, 20,000 calls each, in one process.
"""

import json
import time

import msgspec
import pydantic

from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.serve_requests import OPTION_FIELDS, TranslateRequest

Model = pydantic.create_model(
    "Model",
    __config__=pydantic.ConfigDict(extra="forbid", strict=True),
    texts=(list[str], ...),
    prefixes=(list[str] | None, None),
    constraints=(list[list[str] | None] | None, None),
    suppress=(list[str] | None, None),
    return_scores=(bool, False),
    max_decoding_length=(int | None, None),
    **{name: (field.kind | None, None) for name, field in OPTION_FIELDS.items()},
)


def options(request):
    values = {name: getattr(request, name) for name in OPTION_FIELDS}
    return SearchOptions(**{k: v for k, v in values.items() if v is not None})


BODIES = {
    "1 sentence": b'{"texts": ["Ein Hund rennt."], "beam_size": 4}',
    "32 sentences": json.dumps(
        {"texts": ["Ein Hund rennt durch das Gras und springt."] * 32, "beam_size": 4}
    ).encode(),
}
WAYS = {
    "msgspec.convert": lambda body: msgspec.convert(json.loads(body), TranslateRequest),
    "pydantic.model_validate": lambda body: Model.model_validate(json.loads(body)),
    "msgspec.convert + SearchOptions": lambda body: options(
        msgspec.convert(json.loads(body), TranslateRequest)
    ),
    "pydantic + SearchOptions": lambda body: options(Model.model_validate(json.loads(body))),
}

if __name__ == "__main__":
    for label, body in BODIES.items():
        for name, way in WAYS.items():
            way(body)
            start = time.perf_counter()
            for _ in range(20_000):
                way(body)
            print(f"{label}, {name}: {(time.perf_counter() - start) / 20_000 * 1e6:.2f} us")
