"""A verifiable task the tiny model learns in minutes: copy, reverse or add digit strings.

A prompt is ASCII in byte-tokenizer ids (``glm5_train.tokenizer.ByteTokenizer``: id = byte),
so it reads as text in any record: ``C40172935=`` (copy), ``R40172935=`` (reverse),
``S40172935=`` (running sums: answer digit i is (d_0 + ... + d_i) mod 10). The answer is the
``digits`` digits followed by the end-of-document id 256, which ends generation.

The reward is per position: the fraction of the ``digits`` answer positions the response gets
right (a short response scores its missing positions as wrong, extra tokens after the answer
are ignored), so a policy that is partly right gets a graded signal. ``exact`` says whether
every position is right.

Prompts are drawn from a seeded generator, one stream per split: ``train`` prompt ``i`` and
``heldout`` prompt ``i`` are the same on every machine and every run, and no held-out digit
string is ever a training one: a hash of the string puts one string in ``HELDOUT_BUCKETS`` in
the held-out share, and each split draws again until its string falls in its own share.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy

from glm5_train.rl.records import Rollout

KINDS = {"copy": "C", "reverse": "R", "sum": "S"}
EOD = 256  # the byte tokenizer's end-of-document id
SEPARATOR = ord("=")
ZERO = ord("0")
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 8  # one digit string in 8 can only be a held-out prompt


@dataclass(frozen=True)
class DigitTask:
    kind: str = "copy"
    digits: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task kind={self.kind!r}: use one of {sorted(KINDS)}")
        if not 1 <= self.digits <= 64:
            raise ValueError(f"task digits={self.digits} must lie in [1, 64]")

    @property
    def prompt_length(self) -> int:
        return self.digits + 2  # kind letter, digits, '='

    @property
    def max_new_tokens(self) -> int:
        return self.digits + 1  # the answer and the end-of-document id

    def digit_string(self, index: int, split: str = "train") -> list[int]:
        """The digits (0-9) of prompt ``index`` of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: use one of {list(SPLITS)}")
        return self._split_draw(index, split)

    def prompt(self, index: int, split: str = "train") -> list[int]:
        """Prompt ``index`` of ``split`` as token ids."""
        return self.prompt_of(self.digit_string(index, split))

    def prompt_of(self, digits: list[int]) -> list[int]:
        return [ord(KINDS[self.kind]), *(ZERO + d for d in digits), SEPARATOR]

    def answer(self, prompt_ids: list[int]) -> list[int]:
        """The correct response to ``prompt_ids``: the answer digits, then EOD."""
        digits = self._digits_of(prompt_ids)
        if self.kind == "copy":
            out = digits
        elif self.kind == "reverse":
            out = digits[::-1]
        else:
            out, total = [], 0
            for d in digits:
                total = (total + d) % 10
                out.append(total)
        return [ZERO + d for d in out] + [EOD]

    def reward(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Fraction of the answer's digit positions the response gets right."""
        want = self.answer(prompt_ids)[:-1]
        got = list(response_ids)[:len(want)]
        return sum(int(a == b) for a, b in zip(want, got)) / len(want)

    def exact(self, prompt_ids: list[int], response_ids: list[int]) -> bool:
        """Every answer digit right (what follows them, EOD or not, is not judged)."""
        return self.reward(prompt_ids, response_ids) == 1.0

    def text(self, ids: list[int]) -> str:
        """Ids as readable text (EOD as ``<eod>``)."""
        return "".join("<eod>" if i == EOD else chr(i) if 32 <= i < 127 else f"<{i}>"
                       for i in ids)

    # -- drawing --------------------------------------------------------------------------

    def _digits_of(self, prompt_ids: list[int]) -> list[int]:
        ids = list(prompt_ids)
        if (len(ids) != self.prompt_length or ids[0] != ord(KINDS[self.kind])
                or ids[-1] != SEPARATOR or not all(ZERO <= i <= ZERO + 9 for i in ids[1:-1])):
            raise ValueError(f"not a {self.kind} prompt of {self.digits} digits: "
                             f"{self.text(ids)!r}")
        return [i - ZERO for i in ids[1:-1]]

    def _draw(self, index: int, stream: str) -> list[int]:
        """Digits from a hash of (seed, stream, index): the same everywhere, any order."""
        out: list[int] = []
        block = 0
        while len(out) < self.digits:
            key = f"{self.seed}:{stream}:{index}:{block}".encode()
            out.extend(b % 10 for b in hashlib.blake2b(key, digest_size=32).digest()
                       if b < 250)  # 250 = 25 * 10: unbiased digits
            block += 1
        return out[:self.digits]

    def _split_draw(self, index: int, split: str) -> list[int]:
        """Draw until the string falls in ``split``'s share of all digit strings (a hash
        bucket: one string in HELDOUT_BUCKETS is held out), so the splits never overlap."""
        attempt = 0
        while True:
            digits = self._draw(index, f"{split}{attempt}")
            if self._is_heldout(digits) == (split == "heldout"):
                return digits
            attempt += 1

    def _is_heldout(self, digits: list[int]) -> bool:
        key = f"{self.seed}:bucket:{''.join(map(str, digits))}".encode()
        return hashlib.blake2b(key, digest_size=8).digest()[0] % HELDOUT_BUCKETS == 0


def demonstration_records(task: DigitTask, count: int, first: int = 0) -> list[Rollout]:
    """``count`` solved training prompts as rollout records (response = the answer, reward 1):
    the supervised warm start (``train.objective=lm`` on them trains the responses only)."""
    records = []
    for index in range(first, first + count):
        prompt = task.prompt(index, "train")
        answer = task.answer(prompt)
        records.append(Rollout(numpy.asarray(prompt, dtype=numpy.int64),
                               numpy.asarray(answer, dtype=numpy.int64),
                               numpy.ones(len(answer), dtype=numpy.float32),
                               numpy.zeros(len(answer), dtype=numpy.float32), 1.0,
                               f"demo{index}", 0))
    return records


def add_task_arguments(parser) -> None:
    """The task's flags (``--kind``, ``--digits``, ``--task-seed``) on an argparse parser;
    ``task_from_args`` reads them back."""
    parser.add_argument("--kind", choices=sorted(KINDS), required=True)
    parser.add_argument("--digits", type=int, required=True)
    parser.add_argument("--task-seed", type=int, required=True)


def task_from_args(args) -> DigitTask:
    return DigitTask(args.kind, args.digits, args.task_seed)
