"""Command-line parsers generated from settings dataclasses (fairseq's pattern).

A settings field is one option: its default, and in its metadata its group,
help (where `%(default)s` stands for the default), choices and metavar. The
`train` command's options come from `TrainSettings`, `prepare`'s from
`PrepareSettings`.
"""

from __future__ import annotations

import dataclasses
import typing


def flag(name: str) -> str:
    """The option of field `name`: `--name-with-dashes`."""
    return "--" + name.replace("_", "-")


def option_type(annotation):
    """The one type a field holds besides None: `int | None` -> int."""
    types = [t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)]
    if len(types) != 1:
        raise TypeError(f"An option must hold one type (or None). Received: {annotation}")
    return types[0]


def add_settings_arguments(parser, settings_class, groups):
    """One option per field of the dataclass `settings_class`, in the argument group
    its metadata names (`groups`: {name: title}), with the field's default, help,
    choices and metavar. Returns the groups, to add other options to."""
    sections = {name: parser.add_argument_group(title) for name, title in groups.items()}
    hints = typing.get_type_hints(settings_class)
    for field in dataclasses.fields(settings_class):
        meta = field.metadata
        kind = option_type(hints[field.name])
        kwargs = {"help": meta.get("help")}
        if field.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            if kind is not str:
                kwargs["type"] = kind
            for key in ("choices", "metavar"):
                if key in meta:
                    kwargs[key] = meta[key]
        sections[meta["group"]].add_argument(flag(field.name), **kwargs)
    return sections


def settings_values(args, settings_class) -> dict:
    """The parsed options of the fields of `settings_class`, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_class)}
