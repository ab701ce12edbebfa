"""MTP acceptance length: greedy speculative decoding with the MTP steps as the draft.

    torchrun --nproc-per-node N tools/mtp_accept_length.py --load CKPT [options] \
        model=glm5_tiny parallel=<layout>

Prompts come from held-out text (by default the standard-library files past the built-in
corpus's data.builtin_max_files, never trained on; --text for others), the main model continues
each greedily, and the accept length (tokens per main-model verification: its own token plus
the leading drafts that match) is printed for 1..--draft-steps drafts per round. The MTP
layer(s) draft by applying their shared parameters for --draft-steps steps, as GLM-5 drafts 4
with one layer trained for 3. Why one teacher-forced forward gives real speculative
decoding's figures exactly: glm5_train/speculative.py. Any layout that loads the checkpoint
(TP + SP, PP + VPP with either MTP placement, EP, DP: each data-parallel rank decodes its share
of the prompts); context parallelism is not supported.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable as `torchrun tools/mtp_accept_length.py` from anywhere
    sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402

from glm5_train import checkpoint_store, known_warnings  # noqa: E402
from glm5_train.assembly import build_model  # noqa: E402
from glm5_train.checkpoint import check_model_config, load_checkpoint  # noqa: E402
from glm5_train.job_config import compose_job  # noqa: E402
from glm5_train.plan import resolve_pipeline_layout  # noqa: E402
from glm5_train.speculative import (  # noqa: E402
    held_out_head_accuracy,
    held_out_stdlib_files,
    held_out_windows,
    measure,
)
from glm5_train.tokenizer import build_tokenizer  # noqa: E402
from parallel import mcore_compat, process_groups  # noqa: E402
from parallel.layout import LayoutError, validate_layout  # noqa: E402

_QUIET_RANKS_WAIT_S = 3.0  # how long ranks other than 0 wait before exiting on a refusal

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # a checkpoint of the main job (python -m launch.local), on one process
  python tools/mtp_accept_length.py --load outputs/<run>/checkpoints model=glm5_tiny \
      parallel=single
  # the same in a 2-process layout (TP2 + SP), and the untrained model beside it
  torchrun --nproc-per-node 2 tools/mtp_accept_length.py --load outputs/<run>/checkpoints \
      parallel=tp2
  python tools/mtp_accept_length.py --untrained parallel=single
Output: one line per draft count, `draft_steps=<k> accept_length=<mean> rounds=<n> tokens=<n>`.
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/mtp_accept_length.py", description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--load",
                         help="checkpoint.save directory (its newest complete checkpoint)")
    weights.add_argument("--untrained", action="store_true",
                         help="the model's initial weights (train.seed) instead")
    parser.add_argument("--draft-steps", type=int, default=4,
                        help="most drafts per round; accept length is printed for 1..this "
                             "(default 4, GLM-5's headline figure)")
    parser.add_argument("--samples", type=int, default=8, help="prompts (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="tokens per prompt (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="greedy tokens generated per prompt (default 64)")
    parser.add_argument("--text", nargs="+", metavar="FILE",
                        help="held-out text files to take prompts from (default: the "
                             "standard-library files the built-in corpus leaves out)")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides: model, parallel, dsa, data.tokenizer, ...")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------- checks before work


def option_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numeric options (None: nothing)."""
    for name in ("draft_steps", "samples", "prompt_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {getattr(args, name)}: must be >= 1"
    if args.new_tokens < args.draft_steps + 1:
        return (f"--new-tokens {args.new_tokens} < --draft-steps {args.draft_steps} + 1: no "
                "round's window fits in the generated text; generate more tokens")
    for path in args.text or []:
        if not os.path.isfile(path):
            return f"--text {path}: no such file"
    return None


def compose(args: argparse.Namespace, world: int):
    """The job: the user's overrides; sequences of the whole text's length, each data-parallel
    rank's share in PP micro-batches (fewer, larger forwards; one sequence per micro-batch
    where PP does not divide the share). The MTP steps are set by ``job_problem``, once the
    model is known to have an MTP layer."""
    job = compose_job([*args.overrides, f"train.global_batch_size={args.samples}",
                       f"train.seq_length={args.prompt_tokens + args.new_tokens}",
                       "checkpoint.save=null"])
    par = job.parallel
    model_parallel = (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                      * par.context_parallel_size)
    share = args.samples // max(1, world // model_parallel)
    pp = par.pipeline_model_parallel_size
    job.train.micro_batch_size = share // pp if share and share % pp == 0 else 1
    return job


def job_problem(job, args: argparse.Namespace, world: int) -> str | None:
    """Settings this tool cannot decode with (None: none). Sets the MTP layer(s) to draft
    --draft-steps steps (applied cyclically, parameters shared) and fixes the pipeline
    layout."""
    if not job.model.num_nextn_predict_layers:
        return ("model.num_nextn_predict_layers=0: the model has no MTP layer to draft with; "
                "load a model trained with MTP")
    job.model = dataclasses.replace(job.model, mtp_num_steps=args.draft_steps)
    if job.parallel.context_parallel_size > 1 or job.parallel.cp_groups == "flexible":
        return (f"parallel.context_parallel_size={job.parallel.context_parallel_size}: the "
                "decoder runs without context parallelism; use a layout with CP 1")
    if job.data.paths and not args.text:
        return (f"data.paths={list(job.data.paths)}: held-out prompts come from the built-in "
                "corpus's unused files; for your own data pass --text FILE ... of held-out text")
    try:
        dp = validate_layout(job.parallel, job.model, world, job.train.global_batch_size,
                             job.train.micro_batch_size, job.train.seq_length)
        job.parallel.pipeline_model_parallel_layout = resolve_pipeline_layout(job, dp)
    except LayoutError as err:
        return (f"{err} (the tool sets train.global_batch_size=--samples {args.samples}, "
                f"train.micro_batch_size={job.train.micro_batch_size} and "
                "train.seq_length=--prompt-tokens + --new-tokens)")
    return None


def checkpoint_problem(root: str, job) -> str | None:
    """``root`` holds a complete checkpoint of the job's model (None: it does)."""
    if not os.path.isdir(root):
        return f"--load {root}: no such directory; give a checkpoint.save directory"
    choice = checkpoint_store.choose(root, content=False)
    if choice.path is None:
        why = f" ({choice.describe()})" if choice.notes else ""
        return f"--load {root} holds no complete checkpoint{why}"
    check_model_config(choice.path, job.model)  # another architecture: ValueError, one line
    if trained_steps(root) == 0:
        return (f"--load {root} was trained with model.mtp_num_steps=0: it holds no MTP "
                "weights to draft with; load a checkpoint of a run that trained MTP")
    return None


def trained_steps(root: str) -> int | None:
    """The MTP steps the checkpoint's run trained (its saved model.mtp_num_steps)."""
    path = checkpoint_store.choose(root, content=False).path
    saved = dist_checkpointing.load_common_state_dict(path).get("model_config") or {}
    return saved.get("mtp_num_steps")


# ------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> list[str] | None:
    """Checks (one line each, alike on every rank, before any process group), then decoding.
    Returns rank 0's report lines (None on other ranks)."""
    problem = option_problem(args)
    _, world, _ = process_groups.world_from_env()
    job = compose(args, world)
    problem = problem or job_problem(job, args, world)
    if problem is None and args.load:
        problem = checkpoint_problem(args.load, job)
    if problem is not None:
        raise ValueError(problem)
    tokenizer = build_tokenizer(job.data.tokenizer)
    files = args.text or held_out_stdlib_files(job.data.builtin_max_files)
    held_out_BS = held_out_windows(files, tokenizer, args.samples, args.prompt_tokens,
                                   args.new_tokens)
    mcore_compat.install()
    if world == 1 and "MASTER_PORT" not in os.environ:  # run without torchrun: any free port
        os.environ["MASTER_PORT"] = str(_free_port())
    process_groups.init_distributed(job.parallel, job.train.seed)
    groups = process_groups.groups()
    _, chunks = build_model(job, groups, eod_token_id=tokenizer.eod)
    if args.load:
        load_checkpoint(args.load, chunks, None, None, job.model)
    mbs = job.train.micro_batch_size
    results, text_BS, differs = measure(chunks, held_out_BS[:, :args.prompt_tokens],
                                        args.new_tokens, tokenizer.eod, groups, mbs)
    accuracy = held_out_head_accuracy(chunks, held_out_BS, args.prompt_tokens, groups, mbs)
    if dist.get_rank() != 0:
        return None
    weights = (f"{args.load} (trained with model.mtp_num_steps={trained_steps(args.load)})"
               if args.load else f"initial weights (untrained, train.seed={job.train.seed})")
    sample = tokenizer.detokenize(text_BS[0, args.prompt_tokens:].tolist())
    distinct = len(set(text_BS[:, args.prompt_tokens:].flatten().tolist()))
    heads = " ".join(f"{'main' if h == 0 else f'mtp{h}'}={share:.3f}"
                     for h, share in enumerate(accuracy))
    text = (f"text: {args.samples} prompts x {args.prompt_tokens} held-out tokens, "
            f"{args.new_tokens} greedy tokens each; main head off the greedy text at "
            f"{differs} positions; {distinct} distinct tokens generated")
    return [f"weights: {weights}", text,
            f"first continuation: {sample[:80]!r}",
            f"held-out text, teacher-forced, share of next tokens each head guesses: {heads}",
            *(f"draft_steps={r.draft_steps} accept_length={r.accept_length:.3f} "
              f"rounds={r.rounds} tokens={r.tokens}" for r in results)]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    known_warnings.install()
    try:
        lines = run(args)
    except (ValueError, TypeError, FileNotFoundError, HydraException) as err:
        if _rank() == 0:
            print(f"mtp_accept_length: error: {' '.join(str(err).splitlines())}",
                  file=sys.stderr, flush=True)
        else:  # every rank finds the same problem; torchrun stops the job at the first rank
            time.sleep(_QUIET_RANKS_WAIT_S)  # to exit: rank 0's line must be out by then
        return 2
    for line in lines or []:
        print(line, flush=True)
    if dist.is_initialized():
        dist.barrier()
    process_groups.destroy_distributed()
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
