"""Tokenize text into megatron-core's indexed dataset format (``<prefix>.bin`` + ``<prefix>.idx``).

Inputs ending in ``.jsonl``/``.json`` hold one JSON object per line (text under ``--json-key``);
any other file is one whole document. An end-of-document token follows every document unless
``--no-append-eod``. Nothing is written if any input is bad.

Example::

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/corpus \
        --tokenizer byte
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# megatron-core warns at import about optional GPU libraries that tokenizing never uses.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from glm5_train.data import build_indexed_dataset  # noqa: E402  (re-exported for callers)
from glm5_train.tokenizer import build_tokenizer  # noqa: E402

__all__ = ["build_indexed_dataset", "main"]


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/corpus --tokenizer byte
  python tools/preprocess_data.py --input docs/*.md --output-prefix data/docs \
      --tokenizer tests/data/glm_tiny_tokenizer
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="input files or globs (.jsonl/.json = one document per line)")
    p.add_argument("--output-prefix", required=True,
                   help="output path without extension; writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (default) or a local Hugging Face tokenizer directory")
    p.add_argument("--json-key", default="text", help="jsonl key holding the text (default text)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not append the end-of-document token after each document")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        n_docs, n_tokens = build_indexed_dataset(args.input, args.output_prefix, tokenizer,
                                                 json_key=args.json_key,
                                                 append_eod=args.append_eod)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"preprocess_data: error: {err}", file=sys.stderr)
        return 1
    print(f"documents={n_docs} tokens={n_tokens} prefix={args.output_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
