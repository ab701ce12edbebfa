"""Turn chat jsonl into a packed chat SFT dataset with an assistant-only loss mask.

Each input line is one conversation, ``{"messages": [{"role": "system"|"user"|"assistant"|
"tool", "content": ...}, ...], "tools": [...]}`` (assistant messages may carry OpenAI-style
``tool_calls``). Conversations are rendered with the chat template of a local Hugging Face
tokenizer directory, masked (1 on the assistant's content and end-of-turn token only) and packed,
whole, into sequences of ``--seq-length`` tokens. Writes ``<prefix>.bin/.idx`` (tokens,
megatron-core's indexed dataset: one item per conversation, one document per sequence),
``<prefix>_loss_mask.bin/.idx`` and ``<prefix>.chat_sft.json``; nothing if any input is bad.
Train on it with ``data=chat_sft data.paths=[<prefix>] data.tokenizer=<dir>
train.seq_length=<--seq-length>`` (glm5_train/chat_data.py explains the format).

Example::

    python tools/prepare_chat_sft.py --input chats.jsonl --output-prefix data/sft \
        --tokenizer /models/GLM-5 --seq-length 202752
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

from glm5_train.chat_data import OVERLONG_CHOICES, write_chat_sft_dataset  # noqa: E402
from glm5_train.data import expand_inputs  # noqa: E402


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # with the offline tiny GLM-style tokenizer in the repository
  python tools/prepare_chat_sft.py --input tests/data/chat_small.jsonl --output-prefix data/sft \
      --tokenizer tests/data/glm_tiny_tokenizer --seq-length 256
  # GLM-5's own tokenizer; cut conversations longer than a sequence instead of refusing them
  python tools/prepare_chat_sft.py --input chats.jsonl --output-prefix data/sft \
      --tokenizer /models/GLM-5 --seq-length 202752 --overlong truncate
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="chat jsonl files or globs (one conversation per line)")
    p.add_argument("--output-prefix", required=True,
                   help="output path without extension")
    p.add_argument("--tokenizer", required=True,
                   help="local Hugging Face tokenizer directory with a chat template")
    p.add_argument("--seq-length", type=int, required=True,
                   help="tokens per packed sequence (= train.seq_length of the run)")
    p.add_argument("--overlong", choices=OVERLONG_CHOICES, default="refuse",
                   help="a conversation longer than --seq-length: stop with an error (default) "
                        "or keep its first --seq-length tokens")
    p.add_argument("--open-sequences", type=int, default=64,
                   help="sequences kept open for first-fit packing (1 = next fit; default 64)")
    p.add_argument("--end-of-turn-token", action="append", default=[],
                   help="a token that ends an assistant turn, besides eos and the eos ids of "
                        "the directory's generation_config.json (repeatable)")
    return p.parse_args(argv)


# Dropped conversations named one per line up to this many; the rest counted in one line.
DROPPED_SHOWN = 10


def report_dropped(dropped: list[str]) -> None:
    """Which conversations --overlong truncate dropped (file:line, why): a count alone leaves
    the user to find them."""
    for line in dropped[:DROPPED_SHOWN]:
        print(f"dropped {line}")
    if len(dropped) > DROPPED_SHOWN:
        print(f"dropped ... and {len(dropped) - DROPPED_SHOWN} more")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dropped: list[str] = []
    try:
        meta = write_chat_sft_dataset(expand_inputs(args.input), args.output_prefix,
                                      args.tokenizer, args.seq_length, args.overlong,
                                      args.open_sequences, args.end_of_turn_token, dropped)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"prepare_chat_sft: error: {err}", file=sys.stderr)
        return 1
    report_dropped(dropped)
    # the summary stays the last line, as it was: scripts parse it
    print(f"conversations={meta['conversations']} sequences={meta['sequences']} "
          f"tokens={meta['tokens']} loss_tokens={meta['loss_tokens']} "
          f"truncated={meta['truncated']} dropped={meta['dropped']} fill={meta['fill']:.3f} "
          f"prefix={args.output_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
