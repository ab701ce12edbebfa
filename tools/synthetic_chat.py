"""Write a chat jsonl whose conversations have chosen token lengths (user turn, then an
assistant turn of about a third of it), for measuring length-dependent features: flexible CP
groups (bench/flexible_cp.py), long-context SFT. The text is random words; lengths are hit to
within a few tokens using the tokenizer's measured tokens per word.

    python tools/synthetic_chat.py --output chats.jsonl --tokenizer <hf-dir> \\
        --lengths 40000,3000,900,500
    python tools/synthetic_chat.py --output chats.jsonl --tokenizer <hf-dir> \\
        --long-tail 64 --short-max 8192 --long 65536,131072,202752 --seed 0

``--long-tail N``: N conversations, lengths log-uniform between 128 and ``--short-max``, plus one
conversation at each ``--long`` length. Then ``tools/prepare_chat_sft.py`` makes the dataset.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_train.chat_data import ChatTemplateEncoder, Conversation

WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "shard", "group", "token", "layer", "expert", "router", "cache", "pipeline", "stage", "gradient", "norm", "scale", "sparse", "dense", "index", "query", "key", "value", "latent", "rope", "window", "chunk", "batch", "rank", "node", "host", "device", "stream"]


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/synthetic_chat.py --output chats.jsonl --tokenizer tests/data/glm_tiny_tokenizer \
      --lengths 200,120,80
  python tools/synthetic_chat.py --output chats.jsonl --tokenizer <hf-dir> \
      --long-tail 64 --short-max 8192 --long 65536,131072,202752 --seed 0
"""


def long_tail_lengths(count: int, short_max: int, long: list[int], seed: int) -> list[int]:
    """``count`` lengths log-uniform in [128, short_max], then the ``long`` ones, shuffled."""
    rng = random.Random(seed)
    lengths = [int(math.exp(rng.uniform(math.log(128), math.log(short_max))))
               for _ in range(count)] + list(long)
    rng.shuffle(lengths)
    return lengths


class LengthWriter:
    """Conversations of a target token length under one tokenizer's chat template."""

    def __init__(self, tokenizer_dir: str, seed: int) -> None:
        self.encoder = ChatTemplateEncoder(tokenizer_dir)
        self.rng = random.Random(seed)
        empty = self._encoded_length(0, 0)
        probe = self._encoded_length(3000, 1000)
        self.overhead, self.per_word = empty, (probe - empty) / 4000

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def messages(self, user_words: int, assistant_words: int) -> list[dict]:
        return [{"role": "user", "content": self._text(user_words)},
                {"role": "assistant", "content": self._text(assistant_words)}]

    def _encoded_length(self, user_words: int, assistant_words: int) -> int:
        conv = Conversation(self.messages(user_words, assistant_words), None, "probe")
        return len(self.encoder.encode(conv))

    def conversation(self, tokens: int) -> dict:
        words = max(2, round((tokens - self.overhead) / self.per_word))
        return {"messages": self.messages(words - words // 3, words // 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer dir")
    parser.add_argument("--lengths", help="comma-separated token lengths")
    parser.add_argument("--long-tail", type=int, help="this many short conversations ...")
    parser.add_argument("--short-max", type=int, default=8192)
    parser.add_argument("--long", default="65536,131072,202752",
                        help="... plus one conversation of each of these lengths")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.lengths is None) == (args.long_tail is None):
        parser.error("give exactly one of --lengths and --long-tail")
    if args.lengths is not None:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = long_tail_lengths(args.long_tail, args.short_max,
                                    [int(x) for x in args.long.split(",") if x], args.seed)
    writer = LengthWriter(args.tokenizer, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(writer.conversation(n)) + "\n" for n in lengths)
    print(f"{args.output}: {len(lengths)} conversations, {sum(lengths)} tokens (targets)")


if __name__ == "__main__":
    main()
