"""DSA's sparse attention through the Triton kernels inside the model, on CPU: the call sites a
CUDA run takes, emulated by Triton's interpreter (``dsa.sparse_kernel=triton`` with
``TRITON_INTERPRET=1``), against the torch path (``dsa.sparse_kernel=torch``) on one process.

Layouts: one process; context parallelism with the all-gather exchange on CP2 (each rank's
query rows against the whole sequence's latent keys, T != S: the call that stopped a GPU run at
its first sparse step; CP4's rows are the same call at other zigzag positions, which the GPU
check's kernel parity runs) and head-parallel on CP2 and CP4 (one head per rank); flexible CP groups sized per
conversation ([4] and [2, 2] groups); PP2 x VPP2 with MTP split onto the stage before the loss,
on CP2; the dense warm-up (torch path) then the sparse stage resumed from its checkpoint on
CP2; packed documents (``data.reset_attention_mask``) on CP2. Each is compared with the
torch path on one process over the same data and seed (losses, MTP losses, indexer KL, global
and per-parameter gradient norms, the repo's fp32 parity tolerances), and each run's own
metrics show the kernels ran on every rank that attends (``sparse_kernel_launches``, forward and
backward) and that the layout ran (``assert_layout_ran`` where it applies).

Triton's interpreter is chosen when triton is first imported, and the test session's fork
server (tests/spawn.py) has imported it without; so the cases run in one child process started
with ``TRITON_INTERPRET=1`` (its own fork server, its ranks), which reports each case's
problems as one JSON line; each case is one test here. The interpreter runs a kernel program
in ~7 ms of Python, so the runs are small: 32 tokens, top-k 8, 2 steps, MTP only where a
layout places it.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import traceback

import pytest

from tests import interpreted as tests_interpreted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "tests", "data", "glm_tiny_tokenizer")
_RESULTS = "SPARSE_KERNEL_IN_MODEL_RESULTS "

# Small: 2 steps of 2 sequences of 32 tokens, top-k 8 < 32 so the sparse stage selects;
# without MTP (its layer's attention is one more call of the same kernels per micro-batch),
# but for the pipeline case, which places it.
NO_MTP = "model.mtp_num_steps=0"
SMALL = ["checkpoint.load=null", "train.seq_length=32", "model.index_topk=8",
         "train.global_batch_size=2", "train.train_iters=2", NO_MTP]
WITH_MTP = [o for o in SMALL if o != NO_MTP]
KERNEL, TORCH = "dsa.sparse_kernel=triton", "dsa.sparse_kernel=torch"


def _parity(nprocs: int, layout: list[str], reference: list[str], work: str) -> list[str]:
    """The kernel run in ``layout`` on ``nprocs`` ranks against the torch path on one process
    (``reference`` overrides); the problems found (empty: parity, and the kernels ran)."""
    from tests.parity import FP32, assert_layout_ran, compare, run_job

    ref = _torch_reference(reference, work)
    got = run_job(nprocs, [*layout, KERNEL], os.path.join(work, "kernel"))
    problems = compare(ref.records, got.records, FP32)
    problems += _launch_problems(ref.records, got.records, nprocs)
    try:
        assert_layout_ran(got, nprocs, [*layout, KERNEL])
    except AssertionError as error:
        problems.append(str(error))
    return problems


_REFERENCES: dict[tuple[str, ...], object] = {}  # one torch run per reference, shared by cases


def _torch_reference(reference: list[str], work: str):
    """The torch path on one process with ``reference`` overrides (run once per child)."""
    from tests.parity import run_job

    key = tuple(reference)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_job(1, [*reference, TORCH], os.path.join(work, "reference"))
    return _REFERENCES[key]


def _launch_problems(reference: list[dict], records: list[dict], nprocs: int) -> list[str]:
    """The torch reference launched no kernel; in the kernel run every rank that attends (all
    ranks, but a pipeline's last stage may hold only the output head) launched forward and
    backward kernels, and at least as many forward as backward ones."""
    problems = []
    if any(any(rank) for record in reference for rank in record["sparse_kernel_launches"]):
        problems.append("the torch reference launched kernels")
    final = records[-1]["sparse_kernel_launches"]
    if len(final) != nprocs or not all(fwd > 0 and bwd > 0 for fwd, bwd in final):
        problems.append(f"kernel launches per rank (forward, backward): {final}")
    return problems


# ----------------------------------------------------------------------- the cases


def case_one_process(work: str) -> list[str]:
    return _parity(1, ["parallel=single", *SMALL], ["parallel=single", *SMALL], work)


def case_cp2_all_gather(work: str) -> list[str]:
    return _parity(2, ["parallel=single", "parallel.context_parallel_size=2", *SMALL],
                   ["parallel=single", *SMALL], work)


def case_cp2_head_parallel(work: str) -> list[str]:
    return _head_parallel(2, work)


def case_cp4_head_parallel(work: str) -> list[str]:
    return _head_parallel(4, work)


def _head_parallel(cp: int, work: str) -> list[str]:
    """Head-parallel CP: the queries move to head shards by all-to-all, so every rank's kernel
    call holds all S rows and its N / cp heads. The layout check knows the all-gather
    exchange; this one's proof is its all-to-alls on the CP group, every step, every rank."""
    from tests.parity import FP32, compare, run_job

    layout = ["parallel=single", f"parallel.context_parallel_size={cp}",
              "parallel.cp_comm=head_parallel", *SMALL]
    ref = _torch_reference(["parallel=single", *SMALL], work)
    got = run_job(cp, [*layout, KERNEL], os.path.join(work, "kernel"))
    problems = compare(ref.records, got.records, FP32)
    problems += _launch_problems(ref.records, got.records, cp)
    for record in got.records:
        calls = record["comm_by_op"].get(f"all_to_all:{cp}", {}).get("calls", [])
        if len(calls) != cp or not all(c > 0 for c in calls):
            problems.append(f"step {record['step']}: all-to-all calls on the CP group {calls}")
    return problems


def case_cp2_pp2_vpp2_mtp_split(work: str) -> list[str]:
    """PP2 x VPP2 (4 micro-batches per step) with the MTP layer on the stage before the loss
    (the layout's default placement) and CP2 under it."""
    batch = ["train.global_batch_size=4"]
    return _parity(4, ["parallel=pp2_vpp2", "parallel.context_parallel_size=2", *WITH_MTP,
                       *batch], ["parallel=single", *WITH_MTP, *batch], work)


def case_dense_warmup_then_sparse_stage(work: str) -> list[str]:
    """2 warm-up steps (dense attention, torch: no kernel runs there) saved, then 2 sparse
    steps resumed from that checkpoint: the kernels on CP2 against the torch path."""
    from tests.parity import run_job

    saved = os.path.join(work, "warmup_checkpoint")
    run_job(1, ["parallel=single", *SMALL, "dsa=dense_warmup", f"checkpoint.save={saved}"],
            os.path.join(work, "warmup"))
    resumed = [*SMALL, "train.train_iters=4", f"checkpoint.load={saved}",
               "checkpoint.load_optimizer=false"]
    resumed.remove("checkpoint.load=null")
    return _parity(2, ["parallel=single", "parallel.context_parallel_size=2", *resumed],
                   ["parallel=single", *resumed], work)


def case_packed_documents_cp2(work: str) -> list[str]:
    """Packed short documents (document-causal attention: the selection never crosses a
    document start) on CP2."""
    from tests.test_packed_documents import _short_documents_corpus

    corpus = pathlib.Path(work) / "corpus"
    corpus.mkdir()
    prefix = _short_documents_corpus(corpus)
    data = [f"data.paths=[{prefix}]", "data.reset_attention_mask=true"]
    return _parity(2, ["parallel=single", "parallel.context_parallel_size=2", *SMALL, *data],
                   ["parallel=single", *SMALL, *data], work)


def case_flexible_cp_groups(work: str) -> list[str]:
    """Flexible CP on 4 ranks: packed chat conversations planned into groups of up to 4; the
    run's plans hold a group of 4 and groups of 2. The reference replays the same plans whole
    on one process (``parallel.flexible_cp_plan_ranks``)."""
    from tests.parity import FP32, compare, run_job
    from tests.test_flexible_cp import prepare_chats

    prefix = prepare_chats(work, CHAT_LENGTHS, 128)
    data = ["parallel=single", "data=chat_sft", f"data.paths=[{prefix}]",
            f"data.tokenizer={TOKENIZER}", "data.reset_position_ids=true",
            "train.seq_length=128", "parallel.cp_groups=flexible",
            "parallel.flexible_cp_max_size=4", "checkpoint.load=null", "model.index_topk=8",
            NO_MTP,
            "train.train_iters=2", "train.warmup_iters=0", "train.global_batch_size=2"]
    ref = run_job(1, [*data, "parallel.flexible_cp_plan_ranks=4", TORCH],
                  os.path.join(work, "reference"))
    got = run_job(4, [*data, KERNEL], os.path.join(work, "kernel"))
    problems = compare(ref.records, got.records, FP32)
    problems += _launch_problems(ref.records, got.records, 4)
    sizes = {n for record in got.records for slot in record["flexible_cp"]["group_sizes"]
             for n in slot}
    if not {2, 4} <= sizes:
        problems.append(f"the plans formed groups of {sorted(sizes)}, not of both 4 and 2")
    return problems


# Conversation lengths (tokens) packed into two 128-token sequences: the longest needs a
# group of 4 (32 tokens a rank), the middle ones groups of 2.
CHAT_LENGTHS = "110,60,50,30,20,12"


# ------------------------------------------------------------ running the cases, reporting

CASES = sorted(name for name in list(globals()) if name.startswith("case_"))


def _run_cases(names: list[str]) -> None:
    """The child process: each case under the interpreter; one JSON report line."""
    from glm5_train.model import triton_sparse_mla

    assert triton_sparse_mla.interpreted(), "TRITON_INTERPRET=1 was not in effect"
    outcome = {}
    for name in names:
        work = tempfile.mkdtemp(prefix=f"glm5_{name}_")
        try:
            outcome[name] = globals()[name](work) or None
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that test
            outcome[name] = [traceback.format_exc()[-6000:]]
        tests_interpreted.report(_RESULTS, {name: outcome[name]})
    tests_interpreted.report(_RESULTS, outcome)


@pytest.fixture(scope="module")
def interpreted_cases() -> dict[str, list[str] | None]:
    """{case: None if it passed, else its problems}, from one interpreter-mode process."""
    code = ("import sys; from tests.test_sparse_kernel_in_model import _run_cases; "
            "_run_cases(sys.argv[1:])")
    return tests_interpreted.run(code, CASES, _RESULTS, timeout=1800)


@pytest.mark.parametrize("case", CASES)
def test_kernels_in_the_model_match_the_torch_path(interpreted_cases, case):
    assert case in interpreted_cases, f"{case} did not run"
    assert interpreted_cases[case] is None, "\n".join(interpreted_cases[case])


def test_triton_kernel_switch_is_refused_on_cpu_without_the_interpreter():
    """``dsa.sparse_kernel=triton`` on a CPU machine without ``TRITON_INTERPRET=1`` (this
    test session's case) is refused before any work, in one line naming the fix."""
    from glm5_train.job_config import compose_job
    from glm5_train.model import triton_sparse_mla

    if triton_sparse_mla.interpreted():
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        compose_job(["model=glm5_tiny", KERNEL])
    with pytest.raises(ValueError, match="dsa.sparse_kernel='cuda': use one of"):
        compose_job(["model=glm5_tiny", "dsa.sparse_kernel=cuda"])


def test_triton_kernel_switch_refuses_an_interpreter_that_cannot_run_the_kernels(monkeypatch):
    """Under Triton's interpreter of triton 3.6 (which fails on the kernels' loops with NumPy
    2) the switch is refused before any work, naming the fix."""
    from glm5_train.job_config import compose_job
    from glm5_train.model import triton_sparse_mla

    monkeypatch.setattr(triton_sparse_mla, "interpreted", lambda: True)
    monkeypatch.setattr(triton_sparse_mla.triton, "__version__", "3.6.0")
    with pytest.raises(ValueError, match=r"pip install 'triton>=3.7'"):
        compose_job(["model=glm5_tiny", KERNEL])
    monkeypatch.setattr(triton_sparse_mla.triton, "__version__", "3.7.1")
    compose_job(["model=glm5_tiny", KERNEL])  # accepted
