"""Packed pretraining documents without [S, S]: the memory of one forward + backward of the
tiny GLM-5 over a packed sequence (``data.reset_attention_mask=true``), per token, at 4K to
16K tokens, and the largest tensor any operation made on the way.

    python bench/packed_documents_memory.py [--seq 4096 8192 16384] [--mask-seq 4096]
                                            [--json out.json]

Each length is the real path in this process: the job's config (``model=glm5_tiny``, fp32,
``dsa=sparse``, MTP 3 steps, one micro-batch of one sequence), ``assemble`` (process group of
one, megatron's GPTDataset over a corpus of short documents, model, optimizer), the job's data
iterator and ``step.run_step`` (megatron-core's schedule: batch -> document starts -> model ->
loss -> backward). Measured, exactly, in bytes:

- ``peak_alloc``: the most bytes of tensors made by the step's operations (the batch's own
  included: the data loader runs inside) alive at once, counted by ``AllocationProbe`` (a
  ``TorchDispatchMode``: every operation's outputs; a storage counts from the operation that
  made it until it is freed);
- ``saved_peak``: the most bytes saved for backward at once (the job's own
  ``SavedTensorMeter``, what ``metrics.jsonl`` reports as ``saved_bytes_peak``);
- ``largest``: the most elements of any tensor an operation made, and of any tensor saved for
  backward, against S x S.

``--mask-seq``: the same step at these lengths with megatron's document-causal [1, S, S] mask
in the batch instead of the documents' boundaries (the dataset as it was asked before:
``create_attention_mask``), for comparison: its largest tensor is S x S.

Last line: ``ours=<peak_alloc bytes/token at the longest --seq> baseline=<at the shortest>
ratio=<ours/baseline>`` (flat memory per token: ratio ~1).

Expected time on 2 idle CPU cores with the defaults: about 1 minute (the 16K step ~25 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the repository's modules, imported where they are used
    sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

BASE = ["model=glm5_tiny", "parallel=single", "dsa=sparse", "model.mtp_num_steps=3",
        "train.global_batch_size=1", "train.micro_batch_size=1", "train.params_dtype=fp32",
        "train.train_iters=1", "train.warmup_iters=0", "checkpoint.save=null",
        "checkpoint.load=null", "data.reset_attention_mask=true"]


class AllocationProbe(TorchDispatchMode):
    """Every tensor the operations inside it make: the largest (elements, operation), those of
    ``limit`` elements or more (``over``), and the bytes of storages alive at once (``live``,
    ``peak``). A storage counts once, from the operation whose output it first is until it is
    freed (a finalizer on the storage); an output sharing an input's storage (views, in-place
    and ``out=`` operations) is no new allocation, and storages made outside (parameters,
    gradient buffers) never count."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.largest = (0, "")
        self.limit, self.over = limit, []
        self._alive: set[int] = set()  # data pointers of the counted storages still alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._made(tensor, func, inputs)
        return out

    def _made(self, tensor: torch.Tensor, func, inputs: set[int]) -> None:
        made = f"{func} {tuple(tensor.shape)}"
        if tensor.numel() > self.largest[0]:
            self.largest = (tensor.numel(), made)
        if self.limit is not None and tensor.numel() >= self.limit:
            self.over.append(made)
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in inputs or ptr in self._alive:
            return
        self._alive.add(ptr)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, ptr, nbytes)

    def _freed(self, ptr: int, nbytes: int) -> None:
        self._alive.discard(ptr)
        self.live -= nbytes


def short_documents_corpus(directory: str, tokens: int, seed: int = 0) -> str:
    """A byte-tokenized corpus of ``tokens`` or more tokens in documents of 16 to 4096 bytes
    (log-uniform): a sequence of 16K tokens packs ~20 documents. Its dataset prefix."""
    from glm5_train.data import build_indexed_dataset
    from glm5_train.tokenizer import ByteTokenizer

    gen = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "sparse", "latent", "index", "token", "mtp"]
    docs, total = [], 0
    while total < tokens:
        size = int(math.exp(math.log(16) + float(torch.rand((), generator=gen)) * math.log(256)))
        picks = torch.randint(0, len(words), (size // 6 + 1,), generator=gen).tolist()
        docs.append(" ".join(words[i] for i in picks)[:size])
        total += len(docs[-1]) + 1  # + its end-of-document token
    source = os.path.join(directory, "docs.jsonl")
    with open(source, "w") as handle:
        handle.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prefix = os.path.join(directory, "short_docs")
    build_indexed_dataset([source], prefix, ByteTokenizer())
    return prefix


def _single_process_env() -> None:
    """torchrun's worker environment for one process, unless a launcher gave one."""
    from parallel.process_groups import _free_port

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if os.environ["WORLD_SIZE"] != "1":
        raise SystemExit(f"bench/packed_documents_memory.py runs on one process, not "
                         f"WORLD_SIZE={os.environ['WORLD_SIZE']}: run it with python or "
                         "--nproc-per-node=1")
    os.environ["MASTER_PORT"] = str(_free_port())  # a fresh group per length


def with_megatron_masks(batches, eod: int):
    """The batches as the dataset gave them before: megatron's document-causal bool
    [B, 1, S, S] mask (True = masked out), made by megatron's own function, no boundaries."""
    for batch in batches:
        # Built inside the yield: this generator's frame must not keep the mask alive while
        # the step runs (the job's data loader keeps no reference to a batch it has given).
        yield _masked(batch, eod)


def _masked(batch: dict, eod: int) -> dict:
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    masks = [_get_ltor_masks_and_position_ids(tokens, eod, False, True, False, True)[0]
             for tokens in batch["tokens"]]
    kept = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}
    return {**kept, "attention_mask": torch.stack(masks)}


class _SavedProbe:
    """Wraps the job's SavedTensorMeter's pack hook: the most elements of a saved tensor."""

    def __init__(self, meter) -> None:
        self.largest = 0
        pack = meter._pack

        def counting(tensor: torch.Tensor):
            self.largest = max(self.largest, tensor.numel())
            return pack(tensor)

        meter._pack = counting  # read by meter.hooks() at each forward


def measure(seq: int, prefix: str, route: str = "boundaries") -> dict:
    """One forward + backward at ``seq`` tokens on the packed-documents path (``route``:
    "boundaries", the job's own; "megatron_mask", the batch carrying megatron's [1, S, S]
    mask). Its figures (see the module docstring)."""
    from glm5_train.assembly import assemble, iterators
    from glm5_train.job_config import compose_job
    from glm5_train.step import run_step
    from glm5_train.tokenizer import build_tokenizer
    from parallel.process_groups import destroy_distributed

    _single_process_env()
    job = compose_job([*BASE, f"train.seq_length={seq}", f"model.max_position_embeddings={seq}",
                       f"data.paths=[{prefix}]", f"data.cache_dir={prefix}-cache"])
    rt = assemble(job)
    try:
        saved = _SavedProbe(rt.activations.meter)
        batches = iterators(rt, 0)[0]
        if route == "megatron_mask":
            batches = with_megatron_masks(batches, build_tokenizer(job.data.tokenizer).eod)
        started = time.perf_counter()
        rt.activations.begin_step()
        with AllocationProbe(limit=seq * seq) as probe:
            reports = run_step(rt.chunks, [batches], 1, seq, 1, rt.groups,
                               activations=rt.activations)
        figures = rt.activations.end_step()
        seconds = time.perf_counter() - started
    finally:
        destroy_distributed()
    loss, tokens = (float(x) for x in reports[0]["lm loss"])
    documents = len(rt.dataset[0]["cu_seqlens"]) - 1  # the sample the step ran
    return {"seq": seq, "route": route, "peak_alloc": probe.peak, "saved_peak": figures.peak_bytes,
            "largest": probe.largest[0], "largest_op": probe.largest[1],
            "largest_saved": saved.largest, "at_least_SS": probe.over[:20],
            "documents": documents, "loss": loss / tokens,
            "seconds": seconds}


def report_line(point: dict) -> str:
    s = point["seq"]
    return (f"{point['route']:>13s} seq={s:6d} documents={point['documents']:3d} "
            f"peak_alloc={point['peak_alloc']} B ({point['peak_alloc'] / s:.0f} B/token) "
            f"saved_peak={point['saved_peak']} B ({point['saved_peak'] / s:.0f} B/token) "
            f"largest={point['largest']} ({point['largest'] / s ** 2:.4f} S*S: "
            f"{point['largest_op']}) largest_saved={point['largest_saved']} "
            f"tensors_of_SS={len(point['at_least_SS'])} "
            f"loss={point['loss']:.4f} step={point['seconds']:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384],
                   help="sequence lengths on the job's packed path (boundaries)")
    p.add_argument("--mask-seq", type=int, nargs="*", default=[4096],
                   help="lengths to run with megatron's [1, S, S] mask in the batch instead")
    p.add_argument("--json", help="write every length's figures here")
    args = p.parse_args()
    seqs = sorted(set(args.seq))
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = short_documents_corpus(tmp, 2 * max(seqs + args.mask_seq))
        for seq in seqs:
            points.append(measure(seq, prefix))
            print(report_line(points[-1]), flush=True)
        for seq in sorted(set(args.mask_seq)):
            points.append(measure(seq, prefix, "megatron_mask"))
            print(report_line(points[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(points, handle, indent=1)
    ours = [q for q in points if q["route"] == "boundaries"]
    last, first = ours[-1]["peak_alloc"] / seqs[-1], ours[0]["peak_alloc"] / seqs[0]
    print(f"ours={last:.0f} baseline={first:.0f} ratio={last / first:.4f}")


if __name__ == "__main__":
    main()
