import io

from keras_transformer_runtime.text import decode_lines, read_input


def test_lines_that_are_not_utf8_keep_their_place_and_are_numbered():
    data = b"Ein Hund.\nZwei Kinder.\r\n" + b"Gr\xfc\xdfe\n" + b"\nletzte Zeile"
    lines, undecodable = decode_lines(data)
    assert lines == ["Ein Hund.", "Zwei Kinder.", "Gr\ufffd\ufffde", "", "letzte Zeile"]
    assert undecodable == [3]
    assert decode_lines(b"\n") == ([""], [])  # one empty line
    assert decode_lines(b"a\nb\n") == (["a", "b"], [])


def test_input_lines_from_bytes_and_from_text_streams_alike():
    """Standard input's bytes are read beneath the text layer; a text stream that
    already holds lone surrogates (Python's surrogateescape stdin) gives the same."""
    data = b"ein Hund\n\xff\xfe\nGr\xc3\xbc\xc3\x9fe\n"
    warnings = []
    from_bytes = read_input(io.TextIOWrapper(io.BytesIO(data)), warnings.append)
    escaped = data.decode("utf-8", errors="surrogateescape")
    from_text = read_input(io.StringIO(escaped), warnings.append)
    assert from_bytes == from_text == ["ein Hund", "\ufffd\ufffd", "Grüße"]
    assert (
        warnings
        == ["input: 1 of 3 lines (line 2) not valid UTF-8; their undecodable bytes read as U+FFFD."]
        * 2
    )
    assert read_input(io.StringIO("a\nb"), warnings.append) == ["a", "b"]
    assert len(warnings) == 2  # nothing to say about valid input
