"""Reading lines of UTF-8 text where a few may not be UTF-8.

The training files, `evaluate`'s files and the translators' standard input
all read through `decode_lines`: one bad line keeps its place (line N still
pairs with line N of the other side, output line N still answers input line
N), its undecodable bytes read as U+FFFD, and the caller is told which lines
they were. Pure Python, so the TensorFlow side and this runtime share it.
"""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """One warning line on stderr (the work goes on)."""
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def decode_lines(data: bytes) -> tuple[list[str], list[int]]:
    r"""The lines of `data` without their line ends (\n, and a \r before it),
    and the 1-based numbers of the lines that are not valid UTF-8.

    >>> lines, undecodable = decode_lines(b"ein Hund\r\nGr\xfc\xdfe\n")
    >>> lines == ["ein Hund", "Gr\ufffd\ufffde"], undecodable
    (True, [2])
    >>> decode_lines(b"")
    ([], [])
    """
    try:
        raw_lines, undecodable = data.decode("utf-8").split("\n"), []
    except UnicodeDecodeError:
        raw_lines, undecodable = [], []
        for number, raw in enumerate(data.split(b"\n"), 1):
            try:
                raw_lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raw_lines.append(raw.decode("utf-8", errors="replace"))
                undecodable.append(number)
    if raw_lines and not raw_lines[-1]:
        raw_lines.pop()  # the line end of the last line (or an empty input)
    return [line.rstrip("\r") for line in raw_lines], undecodable


def describe_undecodable(undecodable: list[int], total: int) -> str:
    """ "2 of 300 lines (line 4, 17)": which lines `decode_lines` replaced bytes in.

    >>> describe_undecodable([4, 17], 300)
    '2 of 300 lines (line 4, 17)'
    """
    shown = ", ".join(map(str, undecodable[:10])) + (", ..." if len(undecodable) > 10 else "")
    return f"{len(undecodable)} of {total} lines (line {shown})"


def read_input(stream, warn, whole=False):
    """The lines of `stream` (standard input) to translate, one output line each; or,
    with `whole`, its whole text as one string, line ends included (a document).

    Reads the bytes beneath a text stream, so that a byte that is not UTF-8
    never reaches the tokenizer as a lone surrogate: `warn` names the lines
    whose undecodable bytes read as U+FFFD, and they are translated with the rest.
    """
    data = getattr(stream, "buffer", stream).read()
    if isinstance(data, str):  # a text stream with no bytes beneath (io.StringIO)
        data = data.encode("utf-8", errors="surrogateescape")
    lines, undecodable = decode_lines(data)
    if undecodable:
        warn(
            f"input: {describe_undecodable(undecodable, len(lines))} not valid UTF-8; "
            "their undecodable bytes read as U+FFFD."
        )
    return data.decode("utf-8", errors="replace") if whole else lines
