"""Continuous batching against request batching, in one process: `python -m benchmarks.continuous_batching ONNX_DIR`.

The question: would the server answer more sentences a second if a finished
sentence's rows went to the next waiting sentence at once (continuous
batching, `stream.SearchStream` over `decoder_step_staggered.onnx`) rather
than every sentence of a batch waiting for its longest (the search graphs,
batch by batch)? Both are driven here without HTTP, at saturation (a full
queue: the case continuous batching is for):

- `graph sorted`: batches of `--batch` sentences sorted by length, the
  offline ceiling the server is measured against;
- `graph in order`: the same batches in input order, as the server's batches
  of concurrent requests come;
- `loop in order`: the one search loop over the plain step, batch by batch
  (what an option the graphs do not take runs);
- `streamed`: `--batch` sentences held at every step; each one that ends is
  replaced by the next (`--admit-min`: admit only once that many rows are free).

Every system translates the same sentences; each row gives seconds and
sentences/s, and the streamed outputs' agreement with the graphs'.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import time

from benchmarks.machine import SHARED_MULTI30K, write_report


def read_lines(path, limit):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f][:limit]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.continuous_batching", description=__doc__
    )
    parser.add_argument("onnx_dir")
    parser.add_argument("--source", default=os.path.join(SHARED_MULTI30K, "test_2016_flickr.de.gz"))
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--admit-min", type=int, default=1)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="continuous_batching.json")
    args = parser.parse_args(argv)
    args.argv = argv

    from keras_transformer_runtime.onnx_translator import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions
    from keras_transformer_runtime.stream import SearchStream

    translator = OnnxTranslator(args.onnx_dir, num_threads=args.threads, precision=args.precision)
    lines = read_lines(args.source, args.limit)
    ids = [translator.tokenizer.encode(line) + [2] for line in lines]
    n, size = len(ids), args.batch
    order = sorted(range(n), key=lambda i: len(ids[i]))
    rows = []
    for beam in (int(b) for b in args.beams.split(",")):
        options = SearchOptions(beam_size=beam)

        def batched(indices, loop=False, options=options):
            found = {}
            for start in range(0, n, size):
                part = indices[start : start + size]
                if loop:
                    source, limits = translator._prepare([ids[i] for i in part], None)
                    hypotheses = translator._loop(source, limits, options)
                else:
                    hypotheses = translator.search([ids[i] for i in part], options)
                found.update(zip(part, hypotheses, strict=True))
            return [found[i] for i in range(n)]

        def streamed(options=options):
            stream, found, taken = SearchStream(translator, options), {}, 0
            while taken < n or stream.live:
                room = min(size - stream.live, n - taken)
                if room and (room >= args.admit_min or not stream.live or taken + room == n):
                    new = list(range(taken, taken + room))
                    taken += room
                    found.update(stream.admit(new, [ids[i] for i in new]))
                found.update(stream.step())
            return [found[i] for i in range(n)]

        systems = {
            "graph sorted": lambda: batched(order),
            "graph in order": lambda: batched(list(range(n))),
            "loop in order": lambda: batched(list(range(n)), loop=True),
            "streamed": streamed,
        }
        reference = systems["graph in order"]()  # also warms every session up
        streamed()
        for _ in range(args.repeats):
            for name, run in systems.items():
                started = time.perf_counter()
                found = run()
                seconds = time.perf_counter() - started
                same = sum(a[0].tokens == b[0].tokens for a, b in zip(reference, found, strict=True))
                rows.append(
                    {
                        "system": name,
                        "beam_size": beam,
                        "seconds": round(seconds, 3),
                        "sentences_per_s": round(n / seconds, 1),
                        "same_output_as_graph": round(same / n, 4),
                    }
                )
                print(rows[-1], flush=True)
    return write_report("continuous_batching", args, rows=rows)


if __name__ == "__main__":
    main()
