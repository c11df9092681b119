"""What several readers of a prepared dataset cost: `python -m benchmarks.readers_steps DIR`.

Under `--strategy data-parallel` each of N processes reads its own part of a
prepared directory, and a shared schedule of length buckets gives every
process's batch of a step one shape (`PreparedData.schedule`). A process
short of batches of a bucket sends empty rows, so an epoch can take more
global steps than one process reading everything. This counts them from
the manifest and the lengths alone (no ids read, no model):

    python -m benchmarks.readers_steps data/wmt-de-en --tokens 4096 25000 --readers 2 4 8 \\
        --out benchmarks/results/readers_steps.json
"""

from __future__ import annotations

import argparse
import sys

from keras_transformer.data.shards import PreparedData


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", help="a prepared directory (keras-transformer prepare)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 25000])
    parser.add_argument("--readers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    data = PreparedData(args.data)
    rows = []
    for tokens in args.tokens:
        one = data.batches_per_epoch(tokens)
        for readers in args.readers:
            steps = data.steps_per_epoch(tokens // readers, readers)
            rows.append(
                {
                    "tokens_per_batch": tokens,
                    "readers": readers,
                    "one_reader_batches": one,
                    "global_steps": steps,
                    "extra": round(steps / one - 1, 4),
                }
            )
            print(rows[-1], flush=True)
    from benchmarks.machine import write_report

    return write_report(
        "readers_steps", args, kept_pairs=data.stats().kept_pairs, shards=len(data.shard_names),
        rows=rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
