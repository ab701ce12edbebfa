"""Re-create ``tests/data/glm_tiny_tokenizer`` (how the shipped files were made).

A byte-level BPE of 300 tokens (256 bytes + merges) trained on ``chat_small.jsonl``, GLM's role
and tool tokens added as special tokens, the GLM-style ``chat_template.jinja`` that sits in the
directory, and a ``generation_config.json`` whose eos ids are GLM's three end-of-turn tokens
(``<|endoftext|>``, ``<|user|>``, ``<|observation|>``). Small enough for the glm5_tiny model's
320-token vocabulary.

    python tests/data/make_glm_tiny_tokenizer.py
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "glm_tiny_tokenizer")
SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]
END_OF_TURN = ["<|endoftext|>", "<|user|>", "<|observation|>"]


def chat_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [m.get("content") or "" for line in f for m in json.loads(line)["messages"]]


def main() -> None:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300 - len(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(chat_texts(os.path.join(HERE, "chat_small.jsonl")), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:])
    with open(os.path.join(OUT, "chat_template.jinja"), encoding="utf-8") as f:
        tok.chat_template = f.read()
    tok.save_pretrained(OUT)
    with open(os.path.join(OUT, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": tok.convert_tokens_to_ids(END_OF_TURN)}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
