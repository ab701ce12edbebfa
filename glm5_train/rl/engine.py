"""A rollout engine on Hugging Face transformers: loads a published weight version and samples.

The trainer publishes versions with ``glm5_train.rl.publisher`` (``<versions>/v<N>/`` plus a
``latest`` symlink); ``HfEngine.load`` reads one version directory, ``load_latest`` waits for
and loads the newest. The engine stands in for SGLang / vLLM on a CPU: slow, but exact.

Sampling is pure temperature sampling from the model's full softmax, in a KV-cached loop of
our own rather than ``model.generate``: ``generate`` merges ``generation_config.json`` and its
own defaults into every call (``top_k`` unset becomes 50; the tiny model's file sets
``eos_token_id: 1``), so an unneutralised default would silently truncate the distribution
or stop at the wrong token. The log-prob recorded for each sampled token is
``log_softmax(raw logits)[token]`` in fp32 at temperature 1: the policy's own log-prob, which
is what the trainer recomputes.

DSA top-k ties. HF's indexer picks each query's keys with ``torch.topk``, whose order among
equal scores is unspecified and depends on the row's length; the indexer's ReLU makes
exact-zero scores common, so a decode step (a row of the keys so far) and a teacher-forced
forward (the full row, the future masked) can select different keys among tied ones and give
log-probs 1e-2..1 apart once a sequence is longer than ``index_topk``. The engine breaks ties
as the trainer does (larger score first, then smaller key index:
``glm5_train.model.dsa.rank_keys``), inside the indexer only, so decode, teacher forcing and
the trainer agree.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from glm5_train.rl.publisher import LATEST, VERSION_FILE, complete_versions, latest_version

EOD = 256  # the byte tokenizer's end-of-document id (glm5_train.tokenizer.ByteTokenizer.eod)
POLL_S = 0.1  # how often a waiting loader looks at ``latest``


class Sample(NamedTuple):
    """One generated response: the prompt, the response (its EOD included when it stopped
    there) and one fp32 log-prob per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


def set_threads(threads: int) -> None:
    """Intra-op CPU threads for this process (several workers on one machine each take 1)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: torch's CPU threads must be an integer >= 1; "
                         "pass e.g. 1 per worker process")
    torch.set_num_threads(threads)


class HfEngine:
    """A published version loaded with transformers (fp32, eval mode), ready to sample.

    ``version``, ``written_at`` and ``dtype`` come from the version's ``version.json``;
    ``path`` is the version directory it was loaded from."""

    def __init__(self, model: torch.nn.Module, path: str, version: int, written_at: str = "",
                 dtype: str = "", eod_id: int = EOD) -> None:
        self.model = model.eval()
        self.path, self.version, self.written_at, self.dtype = path, version, written_at, dtype
        self.eod_id = eod_id
        self.vocab_size = int(model.config.vocab_size)
        _break_indexer_ties_by_key_index(self.model)

    @classmethod
    def load(cls, path: str, eod_id: int = EOD) -> HfEngine:
        """Load the version directory ``path`` (not ``latest``: resolve it first, so the
        weights and the version number come from one directory)."""
        from transformers import GlmMoeDsaForCausalLM

        info = read_version_file(path)
        model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model, path, info["version"], info.get("written_at", ""),
                   info.get("dtype", ""), eod_id)

    # -- sampling -------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], samples_per_prompt: int, max_new_tokens: int,
                 seed: int = 0, generator: torch.Generator | None = None,
                 temperature: float = 1.0) -> list[Sample]:
        """``samples_per_prompt`` samples of each prompt, prompt by prompt in order (the
        samples of prompt 0 first). Every row of a call is decoded in one batch (prompts of
        different lengths: one batch per length, so no padding changes the numerics). A row
        stops at its first EOD (included) or after ``max_new_tokens`` tokens. ``generator``
        (else one seeded with ``seed``) draws every token: same weights, prompts and seed give
        the same samples. ``temperature`` scales the sampling logits only; the log-probs
        recorded are always the policy's (temperature 1)."""
        self._check_request(prompts, samples_per_prompt, max_new_tokens, temperature)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
        rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
        samples: list[Sample | None] = [None] * len(rows)
        for length in sorted({len(r) for r in rows}):
            members = [i for i, r in enumerate(rows) if len(r) == length]
            batch = torch.tensor([rows[i] for i in members], dtype=torch.long)
            tokens, logprobs = self._sample_batch(batch, max_new_tokens, generator, temperature)
            for row, i in enumerate(members):
                samples[i] = self._trimmed(rows[i], tokens[row], logprobs[row])
        return samples

    def _sample_batch(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                      generator: torch.Generator, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n] sampled tokens and their fp32 log-probs, n <= max_new_tokens (the loop ends
        early once every row has produced an EOD)."""
        out = self.model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
        finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
        tokens, logprobs = [], []
        for step in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            policy = torch.log_softmax(logits, dim=-1)
            sampling = policy if temperature == 1.0 else torch.log_softmax(logits / temperature, -1)
            token = torch.multinomial(sampling.exp(), 1, generator=generator).squeeze(1)
            tokens.append(token)
            logprobs.append(policy.gather(1, token[:, None]).squeeze(1))
            finished |= token == self.eod_id
            if finished.all() or step == max_new_tokens - 1:
                break
            # finished rows keep decoding (their tokens are dropped): the batch stays whole
            out = self.model(input_ids=token[:, None], cache=out.cache, use_cache=True)
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)

    def _trimmed(self, prompt: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> Sample:
        """A row cut after its first EOD: later tokens were decoded for the batch only."""
        response = tokens.tolist()
        if self.eod_id in response:
            response = response[:response.index(self.eod_id) + 1]
        return Sample(prompt, response, logprobs[:len(response)].tolist())

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """fp32 log-probs of ``response_ids`` after ``prompt_ids``, one teacher-forced forward:
        what ``generate`` should have recorded for the same tokens."""
        self._check_ids(prompt_ids, "prompt_ids")
        self._check_ids(response_ids, "response_ids")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
        logits = self.model(input_ids=ids).logits[0].float()
        # position t predicts token t + 1: the response is predicted from len(prompt) - 1 on
        predicting = logits[len(prompt_ids) - 1:-1]
        targets = torch.tensor(list(response_ids), dtype=torch.long)[:, None]
        return torch.log_softmax(predicting, dim=-1).gather(1, targets).squeeze(1).tolist()

    # -- checks ---------------------------------------------------------------------------

    def _check_request(self, prompts, samples_per_prompt, max_new_tokens, temperature) -> None:
        if not prompts:
            raise ValueError("generate: prompts=[]: nothing to sample; pass at least one prompt")
        for name, value in (("samples_per_prompt", samples_per_prompt),
                            ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"generate: {name}={value!r} must be an integer >= 1")
        if not temperature > 0:
            raise ValueError(f"generate: temperature={temperature!r} must be > 0 (1.0: the "
                             "policy's own distribution)")
        for index, prompt in enumerate(prompts):
            self._check_ids(prompt, f"prompts[{index}]")

    def _check_ids(self, ids, name: str) -> None:
        if len(ids) == 0:
            raise ValueError(f"{name} is empty: a sequence needs >= 1 token id")
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"{name} holds id {bad[0]} outside [0, {self.vocab_size}) (the "
                             f"model's vocab_size); pass ids of this model's tokenizer")


def read_version_file(path: str) -> dict:
    """``path``'s ``version.json`` ({"version", "dtype", "written_at"}). FileNotFoundError when
    it is missing: not a complete version, or one pruned since ``latest`` was resolved."""
    with open(os.path.join(path, VERSION_FILE), encoding="utf-8") as handle:
        info = json.load(handle)
    if isinstance(info.get("version"), bool) or not isinstance(info.get("version"), int):
        raise TypeError(f"{path}/{VERSION_FILE}: version={info.get('version')!r} is not an "
                        "integer; the publisher writes the optimizer step there")
    return info


def load_latest(versions_dir: str, newer_than: int | None = None, wait_s: float | None = None,
                stop: threading.Event | None = None, poll_s: float = POLL_S) -> HfEngine | None:
    """Load the version ``<versions_dir>/latest`` names, once it is newer than ``newer_than``
    (None: any version), polling every ``poll_s`` while there is none. ``latest`` is resolved
    once per try, so weights and version number come from one directory; a version pruned
    while it was being read (its directory gone) is dropped and ``latest`` followed again.
    Returns None when ``stop`` is set first; raises TimeoutError after ``wait_s`` seconds
    (None: wait for ever)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while stop is None or not stop.is_set():
        current = latest_version(versions_dir)
        if current is not None and (newer_than is None or current > newer_than):
            path = os.path.realpath(os.path.join(versions_dir, LATEST))
            try:
                return HfEngine.load(path)
            except Exception:
                if os.path.isdir(path):
                    raise  # the version is there: a real failure, not a prune
                continue  # pruned mid-read: the publisher has moved latest on already
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(_nothing_newer(versions_dir, newer_than, wait_s))
        if stop is None:
            time.sleep(poll_s)
        else:
            stop.wait(poll_s)
    return None


def _nothing_newer(versions_dir: str, newer_than: int | None, wait_s: float) -> str:
    complete = complete_versions(versions_dir) if os.path.isdir(versions_dir) else []
    wanted = "any version" if newer_than is None else f"a version newer than v{newer_than}"
    return (f"no {wanted} in {versions_dir} after {wait_s} s (latest: "
            f"{latest_version(versions_dir)}, complete versions: {complete}); is the trainer "
            "publishing there (rl publication settings)? wait longer or pass the right directory")


# ----------------------------------------------------------------------------------------------
# DSA top-k ties (see the module docstring)
# ----------------------------------------------------------------------------------------------


class _TopkTiesByKeyIndex(TorchFunctionMode):
    """``Tensor.topk`` over the last dimension as a stable descending sort: among equal scores
    the smaller key index comes first (the trainer's selection rule)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        scores, k = args[0], args[1]
        if kwargs.get("dim", -1) not in (-1, scores.dim() - 1) or not kwargs.get("largest", True):
            raise NotImplementedError(f"the indexer's top-k changed shape ({kwargs}); "
                                      "update _TopkTiesByKeyIndex for this transformers")
        ordered = scores.sort(dim=-1, descending=True, stable=True)
        return torch.return_types.topk((ordered.values[..., :k], ordered.indices[..., :k]))


def _break_indexer_ties_by_key_index(model: torch.nn.Module) -> None:
    """Wrap each DSA indexer's forward (this model's instances only: nothing global changes,
    the MoE router's top-k is left alone)."""
    for module in model.modules():
        if type(module).__name__.endswith("Indexer") and not hasattr(module, "_ties_by_index"):
            module.forward = _with_ties_by_key_index(module.forward)
            module._ties_by_index = True


def _with_ties_by_key_index(forward):
    def wrapped(*args, **kwargs):
        with _TopkTiesByKeyIndex():
            return forward(*args, **kwargs)
    return wrapped
