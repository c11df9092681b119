"""`keras-transformer data`: downloads checked against SHA-256, from local mirrors."""

import functools
import gzip
import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import pytest

from keras_transformer import cli
from keras_transformer.data.fetch import MULTI30K, Corpus, FetchError, fetch

MULTI30K_DIR = Path(
    os.environ.get("MULTI30K", Path(__file__).resolve().parents[2] / ".." / "shared/data/multi30k")
)


def _tiny_corpus(folder: Path, **overrides) -> Corpus:
    """Four small gz files in `folder`, described as a corpus with their real digests."""
    folder.mkdir(parents=True, exist_ok=True)
    checksums = {}
    for split in ("train", "val"):
        for language in ("xx", "yy"):
            name = f"{split}.{language}.gz"
            lines = "".join(f"{split} {language} {i}\n" for i in range(50))
            (folder / name).write_bytes(gzip.compress(lines.encode(), mtime=0))
            checksums[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    fields = dict(
        name="tiny",
        description="a test corpus",
        base_url="http://127.0.0.1:1/unused",
        splits=("train", "val"),
        languages=("xx", "yy"),
        checksums=checksums,
        license="test only",
        citation="nobody",
    )
    fields.update(overrides)
    return Corpus(**fields)


def _quiet(_line):
    pass


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_fetch_from_a_file_url_writes_the_published_bytes(tmp_path):
    mirror = tmp_path / "mirror"
    corpus = _tiny_corpus(mirror)
    out = tmp_path / "out"
    paths = fetch(corpus, out, mirror=mirror.as_uri(), log=_quiet)
    assert [p.name for p in paths] == ["train.xx.gz", "train.yy.gz", "val.xx.gz", "val.yy.gz"]
    for path in paths:
        assert path.read_bytes() == (mirror / path.name).read_bytes()
    assert _leftovers(out) == []


def test_fetch_chooses_splits_and_languages_and_takes_a_plain_folder(tmp_path):
    mirror = tmp_path / "mirror"
    corpus = _tiny_corpus(mirror)
    out = tmp_path / "out"
    fetch(corpus, out, mirror=str(mirror), splits=["val"], languages=["yy"], log=_quiet)
    assert sorted(p.name for p in out.iterdir()) == ["val.yy.gz"]


def test_unknown_language_is_named(tmp_path):
    corpus = _tiny_corpus(tmp_path / "mirror")
    with pytest.raises(FetchError, match="no language zz. Choose among: xx, yy"):
        fetch(corpus, tmp_path / "out", languages=["zz"], log=_quiet)


def test_files_already_present_are_not_fetched_again(tmp_path):
    mirror = tmp_path / "mirror"
    corpus = _tiny_corpus(mirror)
    out = tmp_path / "out"
    fetch(corpus, out, mirror=mirror.as_uri(), log=_quiet)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    lines = []
    # The mirror is gone: the second run succeeds only if it reads nothing from it.
    fetch(corpus, out, mirror=(tmp_path / "gone").as_uri(), log=lines.append)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert len(lines) == 4 and all("present, SHA-256 matches" in line for line in lines)


def test_a_present_file_with_another_digest_is_replaced(tmp_path):
    mirror = tmp_path / "mirror"
    corpus = _tiny_corpus(mirror)
    out = tmp_path / "out"
    out.mkdir()
    (out / "val.xx.gz").write_bytes(b"not the published file")
    fetch(corpus, out, mirror=mirror.as_uri(), splits=["val"], log=_quiet)
    assert (out / "val.xx.gz").read_bytes() == (mirror / "val.xx.gz").read_bytes()


def test_wrong_checksum_is_refused_and_nothing_is_left(tmp_path):
    mirror = tmp_path / "mirror"
    good = _tiny_corpus(mirror)
    wrong = "0" * 64
    corpus = _tiny_corpus(mirror, checksums={**good.checksums, "train.yy.gz": wrong})
    out = tmp_path / "out"
    with pytest.raises(FetchError) as error:
        fetch(corpus, out, mirror=mirror.as_uri(), log=_quiet)
    message = str(error.value)
    assert "train.yy.gz" in message
    assert f"expected SHA-256 {wrong}" in message
    assert f"got {good.checksums['train.yy.gz']}" in message
    # The file before it was kept; the refused one and its partial copy are not there.
    assert sorted(p.name for p in out.iterdir()) == ["train.xx.gz"]


@pytest.mark.parametrize(
    "mirror", ["file:///nonexistent-keras-transformer-mirror", "http://127.0.0.1:1"]
)
def test_unreachable_mirror_says_to_retry_or_use_another(tmp_path, mirror):
    corpus = _tiny_corpus(tmp_path / "mirror")
    out = tmp_path / "out"
    with pytest.raises(FetchError) as error:
        fetch(corpus, out, mirror=mirror, log=_quiet)
    message = str(error.value)
    assert f"could not download {mirror}/train.xx.gz" in message
    assert "Retry later, or pass --mirror URL" in message
    assert list(out.iterdir()) == []


@pytest.fixture
def http_mirror(tmp_path):
    """A real HTTP server on the loopback interface serving tmp_path/mirror."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    handler = functools.partial(
        type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": _quiet_log}),
        directory=str(folder),
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _quiet_log(self, *args):
    pass


def test_fetch_over_http_and_an_http_error_is_explained(tmp_path, http_mirror):
    folder, url = http_mirror
    corpus = _tiny_corpus(folder)
    out = tmp_path / "out"
    fetch(corpus, out, mirror=url, splits=["train"], log=_quiet)
    assert (out / "train.xx.gz").read_bytes() == (folder / "train.xx.gz").read_bytes()
    (folder / "val.yy.gz").unlink()
    with pytest.raises(FetchError, match=r"val.yy.gz: HTTP 404 .*--mirror URL"):
        fetch(corpus, out, mirror=url, log=_quiet)
    assert not (out / "val.yy.gz").exists() and _leftovers(out) == []


def test_a_host_that_never_answers_times_out_with_the_message(tmp_path):
    corpus = _tiny_corpus(tmp_path / "mirror")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # connections complete in the backlog; nothing ever answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(FetchError, match=r"no answer within 0.2 s\. Retry later"):
            fetch(corpus, tmp_path / "out", mirror=url, timeout=0.2, log=_quiet)
    finally:
        silent.close()
    assert list((tmp_path / "out").iterdir()) == []


def test_data_list_names_the_corpus_license_citation_and_files(capsys):
    assert cli.main(["data", "list"]) == 0
    text = capsys.readouterr().out
    assert "multi30k:" in text and "non-commercial research" in text
    assert "Elliott et al." in text
    assert all(name in text for name in MULTI30K.checksums)


def test_data_command_turns_an_unreachable_mirror_into_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit, match="^error: could not download .*--mirror URL"):
        cli.main(["data", "multi30k", "--out", str(tmp_path), "--mirror", "http://127.0.0.1:1"])


def test_multi30k_table_covers_every_split_and_language():
    names = MULTI30K.file_names()
    assert len(names) == 9 and set(names) == set(MULTI30K.checksums)
    assert all(len(digest) == 64 for digest in MULTI30K.checksums.values())


@pytest.mark.slow
@pytest.mark.skipif(
    not (MULTI30K_DIR / "train.de.gz").is_file(),
    reason=f"Multi30k not found at {MULTI30K_DIR} (set MULTI30K to its folder)",
)
def test_multi30k_from_a_file_mirror_of_the_published_files(tmp_path):
    out = tmp_path / "multi30k"
    argv = ["data", "multi30k", "--out", str(out), "--mirror", MULTI30K_DIR.resolve().as_uri()]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(MULTI30K.checksums)
    for name in MULTI30K.checksums:
        assert (out / name).read_bytes() == (MULTI30K_DIR / name).read_bytes()
