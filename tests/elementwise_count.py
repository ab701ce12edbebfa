"""Count the bytes the element-wise operators of a training run move, by module: a worker
for tests/test_elementwise.py, run under torchrun with the job's Hydra overrides.

    torchrun --nproc-per-node N tests/elementwise_count.py OUT.json RUN_DIR override...

Every aten operator the run's steps dispatch is counted (its tensor inputs' and outputs'
bytes: what it reads and writes; ``copy_``, ``zero_``, ``fill_`` and the random fills only
write their destination) except matmuls and attention kernels (priced by their FLOPs), views
(no bytes of their own) and collectives (priced as communication). Each is keyed by phase
and module: a forward operator by the innermost module running it; a backward one by the
module whose forward made its autograd node (nodes are tagged when each module's forward
returns, walking back from its outputs to its inputs); ``optimizer`` for what runs outside
both (the optimizer, gradient clipping and zeroing; building, loading and logging around the
steps are not counted). Matmuls (mm, bmm, addmm, baddbmm, and their in-place forms) are
counted in FLOPs instead, keyed "matmul_flops:<phase>:<module>:<op>". Rank 0 writes
{"<phase>:<module>:<op>": [bytes or FLOPs, calls]} of its own operators to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from glm5_train import train as training
from glm5_train.job_config import compose_job

MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear",
                     "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward"})
# matmuls whose FLOPs are counted: the argument holding the left factor
MATMUL_INPUT = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "addmm_": 1, "baddbmm_": 1}
# in-place operators that only write their destination (the first argument): not read
WRITE_ONLY = frozenset({"copy_", "zero_", "fill_", "normal_", "uniform_", "random_"})
# operators that return views or uninitialised memory: no bytes moved
NO_BYTES = frozenset({"view", "_unsafe_view", "expand", "as_strided", "t", "transpose",
                      "permute", "unsqueeze", "squeeze", "slice", "select", "alias", "detach",
                      "_reshape_alias", "split", "split_with_sizes", "chunk", "unbind",
                      "narrow", "empty", "empty_like", "empty_strided", "new_empty",
                      "lift_fresh", "view_as_real", "view_as_complex", "diagonal", "unfold"})


def tensor_bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values)
               if isinstance(t, torch.Tensor))


class ModuleTags:
    """The innermost module running forward, and autograd nodes tagged by the module whose
    forward made them."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, set[int]]] = []
        torch.nn.modules.module.register_module_forward_pre_hook(self._enter)
        torch.nn.modules.module.register_module_forward_hook(self._leave)

    @staticmethod
    def _nodes(values) -> list:
        return [t.grad_fn for t in tree_leaves(values)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    def _enter(self, module, args) -> None:
        self.stack.append((type(module).__name__, {id(n) for n in self._nodes(args)}))

    def _leave(self, module, args, output) -> None:
        name, inputs = self.stack.pop()
        if not torch.is_grad_enabled():
            return
        todo, seen = self._nodes(output), set()
        while todo:  # back from the outputs to the module's inputs; inner modules tagged first
            node = todo.pop()
            if node is None or id(node) in inputs or id(node) in seen:
                continue
            seen.add(id(node))
            node.metadata.setdefault("module", name)
            todo.extend(n for n, _ in node.next_functions)

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else ""


class ElementwiseBytes(TorchDispatchMode):
    def __init__(self, tags: ModuleTags) -> None:
        super().__init__()
        self.tags, self.counts, self.calls = tags, Counter(), Counter()
        self.started = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.started or name in NO_BYTES or func.namespace == "c10d":
            return out  # collectives: priced as communication
        key = f"{self._where()}:{name}"
        if name in MATMUL_INPUT:  # FLOPs: 2 x output elements x the inner dimension
            left = args[MATMUL_INPUT[name]]
            key = "matmul_flops:" + key
            self.counts[key] += 2 * out.numel() * left.shape[-1]
        elif name not in MATMULS:
            inputs = {k: v for k, v in (kwargs or {}).items() if k != "out"}  # written: ``out``
            read = args[1:] if name in WRITE_ONLY else args
            self.counts[key] += tensor_bytes((read, inputs)) + tensor_bytes(out)
        self.calls[key] += 1
        return out

    def _where(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return "backward:" + node.metadata.get("module", "")
        if self.tags.current():
            return "forward:" + self.tags.current()
        return "optimizer:"


def main() -> None:
    out_path, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    job = compose_job(overrides)
    os.makedirs(run_dir, exist_ok=True)
    counter = ElementwiseBytes(ModuleTags())
    first_step = training.train_step

    def counted_step(*args, **kwargs):  # only the steps: not building, loading or logging
        counter.started = True
        try:
            return first_step(*args, **kwargs)
        finally:
            counter.started = False

    training.train_step = counted_step
    with counter:
        training.train(job, run_dir)
    if os.environ.get("RANK", "0") == "0":
        with open(out_path, "w") as handle:
            json.dump({k: [v, counter.calls[k]] for k, v in sorted(counter.counts.items())},
                      handle, indent=0)


if __name__ == "__main__":
    main()
