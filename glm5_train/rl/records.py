"""The rollout-record schema: what rollout engines (SGLang, vLLM, slime) write and the trainer
reads, checked record by record before any step uses it.

Schema version 1 (``SCHEMA_VERSION``), one record per generated rollout:

====================  ==========================  ===========================================
field                 jsonl / parquet type        rule
====================  ==========================  ===========================================
``prompt_ids``        int list / list<int64>      required, >= 1 token, ids in [0, vocab)
``response_ids``      int list / list<int64>      required, >= 1 token, ids in [0, vocab): the
                                                  exact ids the engine generated
``rollout_logprobs``  number list / list<float>   required, one per response token, finite,
                                                  <= 0: the log-prob each token was sampled with
``reward``            number / double             required, finite
``group_id``          str or int / string         required; rollouts of one prompt share it
                                                  (ints become str)
``policy_version``    int / int64                 required, >= 0: the optimizer step of the
                                                  weights that generated the rollout
``loss_mask``         0/1 list / list<float>      optional (absent or null: all 1), one per
                                                  response token; tool-output tokens get 0
``teacher_logprobs``  number list / list<float>   optional (absent or null: none), one per
                                                  response token, finite, <= 0 (distillation)
``metadata``          anything                    optional, free-form, ignored
``schema_version``    int                         optional; if present must be 1
====================  ==========================  ===========================================

Any other top-level field is refused (a misspelt optional field would otherwise vanish).

Files: ``.jsonl``, one JSON object per line (blank lines skipped), or ``.parquet``, one row per
rollout with columns of the same names, whose key-value metadata may carry
``glm5_rollout_schema_version`` (``write_rollouts`` always writes it; another value is refused).
A bad record raises ``RolloutRecordError``, a one-line message naming the file, the record
(``path:line 12`` for jsonl, ``path:row 12`` for parquet, 1-based), the field, the rule and the
fix. Numbers in messages are the file's own values.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
PARQUET_VERSION_KEY = "glm5_rollout_schema_version"
EXTENSIONS = (".jsonl", ".parquet")

REQUIRED_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "reward", "group_id",
                   "policy_version")
OPTIONAL_FIELDS = ("loss_mask", "teacher_logprobs")
IGNORED_FIELDS = ("metadata", "schema_version")  # schema_version is checked, then ignored
KNOWN_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS + IGNORED_FIELDS

# Parquet rows are read and written this many at a time: bounds memory, and keeps a batch's
# list offsets within int32 (256 rows x 200K-token responses is 51M values).
PARQUET_BATCH_ROWS = 256
# File values quoted in messages are cut to this many characters (a message stays one line).
QUOTE_CHARS = 40

LOGPROB_FIX = ("write the log-probability each sampled token had (log-softmax, so <= 0), "
               "not a logit; drop the rollout if the engine returned none")
TOKEN_FIX = "write token ids as integers (list<int64> in parquet)"


class RolloutRecordError(ValueError):
    """A rollout record breaks the schema: one line naming file, record, field, rule and fix."""


@dataclass(frozen=True, eq=False)
class Rollout:
    """One generated rollout, checked. Shapes: P prompt tokens, R response tokens (both >= 1).

    Arrays are read-only (the record is frozen); ``eq=False`` because numpy arrays have no
    single truth value: compare field by field. ``where`` ("path:line 12" / "path:row 12")
    is what messages about this rollout name.
    """

    prompt_ids: numpy.ndarray  # int64 [P]
    response_ids: numpy.ndarray  # int64 [R]: the exact token ids the engine generated
    loss_mask: numpy.ndarray  # float32 [R], 0/1; tool-output tokens inside a response get 0
    rollout_logprobs: numpy.ndarray  # float32 [R], log-prob when sampled (finite, <= 0)
    reward: float  # finite
    group_id: str  # rollouts of one prompt share it
    policy_version: int  # >= 0: the optimizer step of the weights that generated it
    teacher_logprobs: numpy.ndarray | None = None  # float32 [R] (on-policy distillation)
    where: str = ""


# ------------------------------------------------------------------------------ reading


def read_rollouts(paths: Sequence[str], vocab_size: int | None = None) -> list[Rollout]:
    """Every record of ``paths`` (``.jsonl`` or ``.parquet``), in file order, each checked.

    With ``vocab_size`` token ids must lie in [0, vocab_size). Raises ``RolloutRecordError`` at
    the first bad record (or an unknown extension), ``FileNotFoundError`` for a missing path
    (all paths are looked for before any is read).
    """
    if isinstance(paths, str):  # would otherwise be read as a list of one-letter paths
        raise TypeError(f"read_rollouts takes a list of paths, got the string {paths!r}")
    for path in paths:
        _refuse_unknown_extension(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"rollout records file not found: {path}")
    rollouts = []
    for path in paths:
        records = _jsonl_records(path) if path.endswith(".jsonl") else _parquet_records(path)
        rollouts.extend(rollout_from_record(record, where, vocab_size)
                        for record, where in records)
    return rollouts


def _refuse_unknown_extension(path: str) -> None:
    if not path.endswith(EXTENSIONS):
        raise RolloutRecordError(
            f"{path}: unknown rollout-record format (allowed extensions: "
            f"{', '.join(EXTENSIONS)}); fix: write jsonl (one JSON object per line) or parquet "
            "and name the file by its format")


def _jsonl_records(path: str) -> Iterator[tuple[dict, str]]:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                where = f"{path}:line {number}"
                yield _parse_json_object(line, where), where


def _parse_json_object(line: bytes, where: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise _refusal(where, "record", f"not valid JSON ({err})",
                       "one JSON object per line, UTF-8") from None
    if not isinstance(record, dict):
        raise _refusal(where, "record", f"is a JSON {type(record).__name__}, not an object",
                       "one JSON object per line")
    return record


def _parquet_records(path: str) -> Iterator[tuple[dict, str]]:
    """Rows as field -> value mappings; per-token columns come as numpy slices (no per-element
    Python objects), null values of optional columns as absent fields."""
    with _open_parquet(path) as parquet:
        _check_parquet_version(parquet.schema_arrow.metadata or {}, path)
        row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            # metadata is free-form and ignored: present, never converted
            columns = {name: _present if name == "metadata" else _column_reader(batch[name])
                       for name in batch.schema.names}
            for i in range(batch.num_rows):
                row += 1
                record = {name: value(i) for name, value in columns.items()}
                yield ({k: v for k, v in record.items() if v is not None or k in REQUIRED_FIELDS},
                       f"{path}:row {row}")


def _open_parquet(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # ArrowInvalid is a ValueError
        raise RolloutRecordError(f"{path}: not a readable parquet file ({err}); fix: rewrite "
                                 "it, or write jsonl") from None


def _present(_row: int) -> bool:
    return True


def _check_parquet_version(metadata: Mapping[bytes, bytes], path: str) -> None:
    version = metadata.get(PARQUET_VERSION_KEY.encode())
    if version is not None and version != str(SCHEMA_VERSION).encode():
        raise _refusal(f"{path} (file metadata)", PARQUET_VERSION_KEY,
                       f"is {version.decode(errors='replace')!r}, this reader reads schema "
                       f"version {SCHEMA_VERSION}", "convert the file to schema version "
                       f"{SCHEMA_VERSION}, or read it with the release that wrote it")


def _column_reader(column) -> Callable[[int], object]:
    """row index -> that row's value: a numpy slice for list columns, else a Python value."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        values = column.to_pylist()
        return values.__getitem__
    offsets = column.offsets.to_numpy()
    # nulls inside a list come out as NaN here, which the checks refuse
    flat = column.values.to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return lambda i: flat[offsets[i]:offsets[i + 1]] if valid[i] else None


# --------------------------------------------------------------------------- validation


def rollout_from_record(record: Mapping, where: str, vocab_size: int | None = None) -> Rollout:
    """Check one record (a parsed JSON object or parquet row) against the schema; the Rollout.

    Per-token fields may be Python lists or 1-D numpy arrays. Raises ``RolloutRecordError``.
    """
    _check_field_names(record, where)
    _check_schema_version(record, where)
    response_ids = _token_ids(record, "response_ids", where, vocab_size)
    length = len(response_ids)
    teacher = record.get("teacher_logprobs")
    return Rollout(
        prompt_ids=_token_ids(record, "prompt_ids", where, vocab_size),
        response_ids=response_ids,
        loss_mask=_loss_mask(record.get("loss_mask"), length, where),
        rollout_logprobs=_logprobs(record["rollout_logprobs"], "rollout_logprobs", length,
                                   where),
        reward=_reward(record["reward"], where),
        group_id=_group_id(record["group_id"], where),
        policy_version=_policy_version(record["policy_version"], where),
        teacher_logprobs=(None if teacher is None
                          else _logprobs(teacher, "teacher_logprobs", length, where)),
        where=where)


def _refusal(where: str, field: str, problem: str, fix: str) -> RolloutRecordError:
    message = f"{where}: field {field!r}: {problem}; fix: {fix}"
    return RolloutRecordError(" ".join(message.splitlines()))


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."


def _check_field_names(record: Mapping, where: str) -> None:
    for name in record:
        if name not in KNOWN_FIELDS:
            raise _refusal(where, str(name)[:QUOTE_CHARS], "unknown field (allowed: "
                           f"{', '.join(KNOWN_FIELDS)})", "check the spelling, or put "
                           "engine-specific data under 'metadata' (free-form, ignored)")
    for name in REQUIRED_FIELDS:
        if name not in record:
            raise _refusal(where, name, "missing (every record needs "
                           f"{', '.join(REQUIRED_FIELDS)})", f"have the engine write {name!r}")
        if record[name] is None:
            raise _refusal(where, name, "is null (a required field)",
                           f"have the engine write {name!r}, or drop the record")


def _check_schema_version(record: Mapping, where: str) -> None:
    version = record.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version != SCHEMA_VERSION:
        raise _refusal(where, "schema_version", f"is {_quote(version)}, this reader reads "
                       f"schema version {SCHEMA_VERSION}", "convert the records to schema "
                       f"version {SCHEMA_VERSION}, or read them with the release that wrote them")


def _numbers(values: object, field: str, where: str, types: tuple[type, ...], kinds: str,
             what: str, fix: str) -> numpy.ndarray:
    """``values`` as a 1-D array, if every element is one of ``types`` (a list) or the array's
    dtype kind is in ``kinds``; the type test runs in C (``set(map(type, ...))``), so a
    200K-token list costs milliseconds."""
    if isinstance(values, numpy.ndarray):
        if values.ndim == 1 and values.dtype.kind in kinds:
            return values
        raise _refusal(where, field, f"is an array of {values.dtype} with shape "
                       f"{values.shape}, not a list of {what}", fix)
    if not isinstance(values, (list, tuple)):
        raise _refusal(where, field, f"is {_quote(values)}, not a list of {what}", fix)
    if not set(map(type, values)) <= set(types):
        index = next(i for i, v in enumerate(values) if type(v) not in types)
        raise _refusal(where, field, f"{field}[{index}] = {_quote(values[index])} is not "
                       f"{what}", fix)
    try:
        return numpy.asarray(values, dtype=numpy.int64 if types == (int,) else numpy.float64)
    except OverflowError:
        index = next(i for i, v in enumerate(values) if abs(v) >= 2**63)
        raise _refusal(where, field, f"{field}[{index}] = {_quote(values[index])} does not "
                       "fit 64 bits", fix) from None


def _read_only(array: numpy.ndarray) -> numpy.ndarray:
    """A read-only view: the caller's own array (``write_rollouts``'s input) stays writable."""
    view = array.view()
    view.flags.writeable = False
    return view


def _is_integer(value: object) -> bool:
    """A JSON / parquet integer, or a numpy one (rollouts a caller built); never a bool."""
    return isinstance(value, (int, numpy.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_integer(value) or isinstance(value, (float, numpy.floating))


def _token_ids(record: Mapping, field: str, where: str, vocab_size: int | None) -> numpy.ndarray:
    ids = _numbers(record[field], field, where, (int,), "iu", "integers", TOKEN_FIX)
    if len(ids) == 0:
        raise _refusal(where, field, "is empty (a rollout needs >= 1 prompt and >= 1 response "
                       "token)", "drop the record")
    outside = ids < 0
    if vocab_size is not None:
        outside |= ids >= vocab_size
    bad = numpy.flatnonzero(outside)
    if len(bad):
        rule = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise _refusal(where, field, f"{field}[{bad[0]}] = {ids[bad[0]]} is outside {rule}",
                       "token ids must come from the model's tokenizer: check the engine's "
                       "tokenizer and model.vocab_size")
    return _read_only(ids.astype(numpy.int64, copy=False))


def _check_length(values: numpy.ndarray, field: str, length: int, where: str) -> None:
    if len(values) != length:
        raise _refusal(where, field, f"has {len(values)} values but response_ids has {length} "
                       "tokens (one per response token)", "write one value per response token")


def _logprobs(values: object, field: str, length: int, where: str) -> numpy.ndarray:
    """float32 [length]; the sign and NaN are judged on the file's values, float32's range
    after the cast (a value below it would become -inf)."""
    exact = _numbers(values, field, where, (int, float), "iuf", "numbers", LOGPROB_FIX)
    _check_length(exact, field, length, where)
    single = exact.astype(numpy.float32, copy=False)
    with numpy.errstate(invalid="ignore"):
        good = numpy.isfinite(exact) & (exact <= 0) & numpy.isfinite(single)
    if not good.all():
        index = int(numpy.argmin(good))
        value = float(exact[index])
        problem = ("is NaN" if math.isnan(value) else "is > 0" if value > 0
                   else "is not finite" if not math.isfinite(value) else "is below float32's range")
        raise _refusal(where, field, f"{field}[{index}] = {_quote(value)} {problem} "
                       "(log-probs must be finite and <= 0)", LOGPROB_FIX)
    return _read_only(single)


def _loss_mask(values: object, length: int, where: str) -> numpy.ndarray:
    if values is None:
        return _read_only(numpy.ones(length, dtype=numpy.float32))
    fix = "1 for tokens the policy generated, 0 for tool output inside the response"
    mask = _numbers(values, "loss_mask", where, (int, float, bool), "iufb", "0/1 values", fix)
    _check_length(mask, "loss_mask", length, where)
    good = (mask == 0) | (mask == 1)
    if not good.all():
        index = int(numpy.argmin(good))
        raise _refusal(where, "loss_mask", f"loss_mask[{index}] = {_quote(mask[index].item())} "
                       "is not 0 or 1", fix)
    return _read_only(mask.astype(numpy.float32))


def _reward(value: object, where: str) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _refusal(where, "reward", f"is {_quote(value)}, not a finite number",
                       "a reward function that failed should drop the rollout, not write "
                       "NaN, inf or null")
    return float(value)


def _group_id(value: object, where: str) -> str:
    if not (_is_integer(value) or (isinstance(value, str) and value)):
        raise _refusal(where, "group_id", f"is {_quote(value)}, not a non-empty string or an "
                       "integer", "write one id (string or integer) per prompt, shared by its "
                       "rollouts")
    return value if isinstance(value, str) else str(int(value))


def _policy_version(value: object, where: str) -> int:
    if not _is_integer(value) or value < 0:
        raise _refusal(where, "policy_version", f"is {_quote(value)}, not an integer >= 0",
                       "write the optimizer step of the weights that generated the rollout "
                       "(0 for the initial weights)")
    return int(value)


# ------------------------------------------------------------------------------ writing


def write_rollouts(path: str, rollouts: Sequence[Rollout]) -> None:
    """Write ``rollouts`` to ``path`` (``.jsonl`` or ``.parquet``) so that ``read_rollouts``
    gives them back exactly (arrays as int64 / float32). Each is checked first, so a file is
    never written that the reader refuses. Atomic: a temporary file, then ``os.replace``.
    ``where`` is not written (the file's record numbers replace it). A missing parent
    directory is created."""
    _refuse_unknown_extension(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    unit = "line" if path.endswith(".jsonl") else "row"
    checked = [_checked_for_writing(r, f"{path}:{unit} {i} (being written)")
               for i, r in enumerate(rollouts, start=1)]
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        if unit == "line":
            _write_jsonl(temporary, checked)
        else:
            _write_parquet(temporary, checked)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _checked_for_writing(rollout: Rollout, where: str) -> Rollout:
    record = {name: getattr(rollout, name) for name in REQUIRED_FIELDS + OPTIONAL_FIELDS}
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs",
                 "teacher_logprobs"):
        if record[name] is not None:
            record[name] = numpy.asarray(record[name])
    return rollout_from_record(record, where)


def _jsonl_line(rollout: Rollout) -> str:
    record = {"schema_version": SCHEMA_VERSION,
              "prompt_ids": rollout.prompt_ids.tolist(),
              "response_ids": rollout.response_ids.tolist(),
              # float32 -> Python float is exact, and json writes the shortest repr that
              # parses back to it, so reading and casting to float32 gives the same bits
              "rollout_logprobs": rollout.rollout_logprobs.tolist(),
              "reward": rollout.reward,
              "group_id": rollout.group_id,
              "policy_version": rollout.policy_version}
    if not (rollout.loss_mask == 1).all():  # absent means all 1: saves a 200K-entry list
        record["loss_mask"] = rollout.loss_mask.astype(numpy.int8).tolist()
    if rollout.teacher_logprobs is not None:
        record["teacher_logprobs"] = rollout.teacher_logprobs.tolist()
    return json.dumps(record, separators=(",", ":")) + "\n"


def _write_jsonl(path: str, rollouts: list[Rollout]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(_jsonl_line(r) for r in rollouts)


def _parquet_schema():
    return pa.schema([
        ("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.float32())), ("rollout_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()), ("group_id", pa.string()), ("policy_version", pa.int64()),
        ("teacher_logprobs", pa.list_(pa.float32())),
    ], metadata={PARQUET_VERSION_KEY: str(SCHEMA_VERSION)})


def _list_column(arrays: list[numpy.ndarray | None], value_type):
    """A list<value_type> column from numpy arrays (None: a null row), built from one
    concatenated buffer and its offsets."""
    lengths = [0 if a is None else len(a) for a in arrays]
    offsets = numpy.zeros(len(arrays) + 1, dtype=numpy.int32)
    numpy.cumsum(lengths, out=offsets[1:])
    present = [a for a in arrays if a is not None]
    values = numpy.concatenate(present) if present else numpy.empty(0)
    nulls = numpy.array([a is None for a in arrays], dtype=bool)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type),
                                    mask=pa.array(nulls) if nulls.any() else None)


def _parquet_batch(rollouts: list[Rollout], schema):
    def lists(name, value_type):
        return _list_column([getattr(r, name) for r in rollouts], value_type)

    columns = [lists("prompt_ids", pa.int64()), lists("response_ids", pa.int64()),
               lists("loss_mask", pa.float32()), lists("rollout_logprobs", pa.float32()),
               pa.array([r.reward for r in rollouts], type=pa.float64()),
               pa.array([r.group_id for r in rollouts], type=pa.string()),
               pa.array([r.policy_version for r in rollouts], type=pa.int64()),
               lists("teacher_logprobs", pa.float32())]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _write_parquet(path: str, rollouts: list[Rollout]) -> None:
    schema = _parquet_schema()
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(rollouts), PARQUET_BATCH_ROWS):
            writer.write_batch(_parquet_batch(rollouts[start:start + PARQUET_BATCH_ROWS], schema))


# ------------------------------------------------------------------ groups and versions


def check_groups(rollouts: Sequence[Rollout], min_size: int) -> None:
    """Refuse a group with fewer than ``min_size`` rollouts (GRPO compares rewards within a
    group, so it needs >= 2); the message names the first such group in file order."""
    if type(min_size) is not int or min_size < 1:
        raise ValueError(f"check_groups: min_size={min_size!r}; fix: an integer >= 1")
    members: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        members.setdefault(rollout.group_id, []).append(rollout)
    for group_id, group in members.items():
        if len(group) < min_size:
            raise _refusal(group[0].where, "group_id",
                           f"group {group_id!r} (first record here) has {len(group)} "
                           f"rollout(s), fewer than min_size={min_size} (group-relative "
                           "advantages compare rewards within a group)",
                           "generate more rollouts per prompt, or drop the group, or use "
                           "train.objective=distill, which needs no groups")


def check_versions(rollouts: Sequence[Rollout], learner_version: int) -> None:
    """Refuse the first rollout generated by weights newer than the learner's
    (``policy_version > learner_version``): it comes from the future of this run."""
    for rollout in rollouts:
        if rollout.policy_version > learner_version:
            raise _refusal(rollout.where, "policy_version",
                           f"is {rollout.policy_version}, from the future: the learner is at "
                           f"step {learner_version} (rule: policy_version <= the learner's "
                           "step)", "the records come from another run or a later checkpoint: "
                           "resume the matching checkpoint, or drop these records")


def group_advantages(rollouts: Sequence[Rollout], divide_by_std: bool = True,
                     eps: float = 1e-6) -> numpy.ndarray:
    """GRPO's group-relative advantages, float64 [N] in the order of ``rollouts``:
    ``(reward - group mean) / (group std + eps)``, or ``reward - group mean`` without
    ``divide_by_std``. The std is the unbiased one (ddof=1, ``torch.std``'s default), as
    DeepSeekMath's GRPO and slime use, so with ``divide_by_std`` every group needs >= 2
    rollouts (``check_groups`` names a smaller one)."""
    if not rollouts:
        return numpy.zeros(0, dtype=numpy.float64)
    rewards = numpy.array([r.reward for r in rollouts], dtype=numpy.float64)
    _, group_of = numpy.unique([r.group_id for r in rollouts], return_inverse=True)
    sizes = numpy.bincount(group_of)
    centred = rewards - (numpy.bincount(group_of, weights=rewards) / sizes)[group_of]
    if not divide_by_std:
        return centred
    if (sizes < 2).any():
        check_groups(rollouts, 2)
    # two passes (mean, then squared deviations) keep the variance accurate
    variances = numpy.bincount(group_of, weights=centred**2) / (sizes - 1)
    return centred / (numpy.sqrt(variances)[group_of] + eps)
