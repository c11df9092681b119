"""`keras-transformer data NAME`: download a published corpus and check its SHA-256.

A corpus is described once, as a `Corpus` row in `CORPORA`: where its files
are published, which files there are, the SHA-256 of each and how to cite it.
Every file is streamed to a temporary file in the output folder and renamed
to its own name only once its digest matches the table, so a folder never
holds a partial or altered file under a real name. Files already present
with the right digest are not fetched again, which makes the command safe to
rerun. When the host is down, `--mirror URL` names any other place holding
the same file names (another http(s) host, a `file://` URL or a local folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

_CHUNK = 1 << 20


class FetchError(Exception):
    """A corpus file could not be downloaded, or was not the published file."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A published corpus: where its files are, their digests and how to cite it.

    Files are named `pattern.format(split=..., language=...)`; `checksums`
    holds the SHA-256 (hex) of every such file.
    """

    name: str  # the command's name: `keras-transformer data NAME`
    description: str  # one line: what the corpus is
    base_url: str  # the published folder; a file's URL is base_url + "/" + file name
    splits: tuple[str, ...]
    languages: tuple[str, ...]
    checksums: dict[str, str]  # file name -> SHA-256, hex
    license: str  # terms of use, in one or two sentences
    citation: str  # what to cite when publishing results on it
    pattern: str = "{split}.{language}.gz"

    def file_names(self, splits=None, languages=None) -> list[str]:
        """The files of the chosen splits and languages (default: all), checked to exist."""
        chosen = []
        for kind, values, known in (
            ("split", splits, self.splits),
            ("language", languages, self.languages),
        ):
            values = tuple(values or known)
            unknown = [v for v in values if v not in known]
            if unknown:
                raise FetchError(
                    f"{self.name} has no {kind} {', '.join(unknown)}. "
                    f"Choose among: {', '.join(known)}"
                )
            chosen.append(values)
        names = [
            self.pattern.format(split=s, language=lang) for s in chosen[0] for lang in chosen[1]
        ]
        missing = [n for n in names if n not in self.checksums]
        if missing:
            raise FetchError(f"{self.name}: no checksum for {', '.join(missing)}")
        return names


# The digests were taken from copies of the published files (multi30k/dataset,
# data/task1/raw/) kept in ../shared/data/multi30k/, the folder the slow tests read.
MULTI30K = Corpus(
    name="multi30k",
    description="Multi30k task 1: image descriptions in English, German and French, "
    "sentence-aligned (train 29,000, val 1,014, test_2016_flickr 1,000 lines; gzipped text)",
    base_url="https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw",
    splits=("train", "val", "test_2016_flickr"),
    languages=("de", "en", "fr"),
    checksums={
        "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
        "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
        "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
        "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
        "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
        "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
        "test_2016_flickr.de.gz": (
            "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"
        ),
        "test_2016_flickr.en.gz": (
            "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"
        ),
        "test_2016_flickr.fr.gz": (
            "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90"
        ),
    },
    license="Derived from Flickr30K; distributed for non-commercial research and education.",
    citation='Elliott et al., "Multi30K: Multilingual English-German Image Descriptions", '
    "Proceedings of the 5th Workshop on Vision and Language, 2016",
)

CORPORA = {corpus.name: corpus for corpus in (MULTI30K,)}


def describe(corpus: Corpus) -> str:
    """A few lines naming the corpus, its terms, its citation and its files."""
    return "\n".join(
        [
            f"{corpus.name}: {corpus.description}",
            f"  license: {corpus.license}",
            f"  cite: {corpus.citation}",
            f"  from: {corpus.base_url}",
            f"  files: {' '.join(corpus.file_names())}",
        ]
    )


def sha256_of(path) -> str:
    """The SHA-256 of a file, hex, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def base_url_of(mirror: str) -> str:
    """A mirror given as a URL, or as a local folder (turned into a file:// URL)."""
    if urllib.parse.urlsplit(mirror).scheme in ("http", "https", "file", "ftp"):
        return mirror.rstrip("/")
    return Path(mirror).resolve().as_uri()


def _unreachable(url: str, error: OSError, timeout: float) -> FetchError:
    """The message for a host that is down, refuses, times out or answers an HTTP error."""
    if isinstance(error, urllib.error.HTTPError):
        reason = f"HTTP {error.code} {error.reason}"
    elif isinstance(error, TimeoutError) or (
        isinstance(error, urllib.error.URLError) and isinstance(error.reason, TimeoutError)
    ):
        reason = f"no answer within {timeout:g} s"
    elif isinstance(error, urllib.error.URLError):
        reason = str(error.reason)
    else:
        reason = str(error)
    return FetchError(
        f"could not download {url}: {reason}. Retry later, or pass --mirror URL: another "
        "http(s) host, a file:// URL or a local folder holding the same file names."
    )


def download_file(url: str, path: Path, sha256: str, *, timeout: float = 60.0) -> None:
    """Stream `url` to `path`, keeping it only if its SHA-256 is `sha256`.

    The bytes go to a temporary file beside `path`, renamed once the digest
    matches; on any failure the temporary file is removed.
    """
    # Hidden, and named after this process so that two runs never share one.
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            try:
                response = urllib.request.urlopen(url, timeout=timeout)
            except OSError as error:  # URLError, HTTPError and timeouts are OSErrors
                raise _unreachable(url, error, timeout) from None
            with response:
                while True:
                    try:
                        chunk = response.read(_CHUNK)
                    except OSError as error:
                        raise _unreachable(url, error, timeout) from None
                    if not chunk:
                        break
                    digest.update(chunk)
                    out.write(chunk)
        actual = digest.hexdigest()
        if actual != sha256:
            raise FetchError(
                f"{path.name} from {url} is not the published file: expected SHA-256 {sha256}, "
                f"got {actual}. Nothing was kept; check the mirror, or retry."
            )
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def fetch(
    corpus: Corpus,
    out_dir,
    *,
    mirror: str | None = None,
    splits=None,
    languages=None,
    timeout: float = 60.0,
    log=print,
) -> list[Path]:
    """Download the chosen files of `corpus` into `out_dir`; returns their paths.

    A file already there with the published SHA-256 is kept as is; one with
    another digest is downloaded again and replaced only once the new copy
    matches.
    """
    names = corpus.file_names(splits, languages)
    base = base_url_of(mirror) if mirror else corpus.base_url
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        path = out_dir / name
        expected = corpus.checksums[name]
        if path.is_file():
            actual = sha256_of(path)
            if actual == expected:
                log(f"{path}: present, SHA-256 matches")
                paths.append(path)
                continue
            log(f"{path}: SHA-256 {actual} is not the published {expected}; downloading again")
        url = f"{base}/{name}"
        log(f"{path}: downloading {url}")
        download_file(url, path, expected, timeout=timeout)
        paths.append(path)
    return paths


def add_data_arguments(parser) -> None:
    """`data`'s subcommands: `list`, and one per corpus in `CORPORA`."""
    sub = parser.add_subparsers(
        dest="corpus", required=True, metavar="{list," + ",".join(CORPORA) + "}"
    )
    listing = sub.add_parser("list", help="name each corpus, its license, citation and files")
    listing.set_defaults(corpus="list")
    for corpus in CORPORA.values():
        command = sub.add_parser(
            corpus.name,
            help=f"download {corpus.name} and check every file's SHA-256",
            description=describe(corpus),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--out",
            default=f"data/{corpus.name}",
            help="folder to write the files to (default: %(default)s)",
        )
        command.add_argument(
            "--mirror",
            metavar="URL",
            help="fetch from this base URL instead (http(s)://, file:// or a local folder "
            "holding the same file names); default: " + corpus.base_url,
        )
        command.add_argument("--splits", nargs="+", choices=corpus.splits, help="default: all")
        command.add_argument(
            "--languages", nargs="+", choices=corpus.languages, help="default: all"
        )
        command.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            help="seconds to wait on the host before giving up (default %(default)s)",
        )


def data_command(args) -> int:
    """Run `keras-transformer data ...` from parsed arguments."""
    if args.corpus == "list":
        print("\n\n".join(describe(corpus) for corpus in CORPORA.values()))
        return 0
    corpus = CORPORA[args.corpus]
    paths = fetch(
        corpus,
        args.out,
        mirror=args.mirror,
        splits=args.splits,
        languages=args.languages,
        timeout=args.timeout,
    )
    print(f"{len(paths)} files of {corpus.name} in {args.out}. {corpus.license}")
    print(f"Cite: {corpus.citation}")
    return 0
