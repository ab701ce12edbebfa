"""docs/journeys.md, run as written: each journey's fenced bash blocks, parsed from the page
and run in one bash (-euo pipefail) in a fresh directory that looks like the checkout (its
code, configs, tests/data and data/ linked in), so the page cannot drift from what is tested.
Journey 4 (slurm) needs a cluster: its command is checked to be the one tests/test_slurm.py
runs on its two-node test cluster, and planned here for a two-node allocation.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from omegaconf import OmegaConf

from launch.slurm import compose_tree
from launch.slurm_plan import Allocation, parallel_config, plan_processes
from tests.test_slurm import readme_sbatch_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "journeys.md")
# What the journeys read from the checkout (data/ holds the built-in corpus once built)
CHECKOUT_ENTRIES = ("launch", "tools", "tests", "configs", "glm5_train", "parallel", "data")
HEADING = re.compile(r"^## Journey (\d+): (.*)$", re.MULTILINE)
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
JOURNEY_TIMEOUT_S = 900


def journeys(path: str = PAGE) -> dict[int, tuple[str, str, list[str]]]:
    """{number: (title, text, [bash blocks])} for every '## Journey N: title' section."""
    with open(path) as f:
        text = f.read()
    found = {}
    heads = list(HEADING.finditer(text))
    for head, following in zip(heads, heads[1:] + [None]):
        body = text[head.end():following.start() if following else len(text)]
        found[int(head.group(1))] = (head.group(2), body, BLOCK.findall(body))
    return found


def checkout_like(tmp_path) -> str:
    """A directory that looks like the checkout to the journeys' commands; runs/ is its own."""
    for entry in CHECKOUT_ENTRIES:
        os.symlink(os.path.join(REPO, entry), tmp_path / entry)
    return str(tmp_path)


def run_journey(number: int, tmp_path) -> subprocess.CompletedProcess:
    _, _, blocks = journeys()[number]
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(["bash", "-c", script], cwd=checkout_like(tmp_path), env=env,
                          capture_output=True, text=True, timeout=JOURNEY_TIMEOUT_S, check=False)
    assert done.returncode == 0, (f"journey {number} failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done


def metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def test_every_journey_says_what_the_user_gets_and_has_commands():
    found = journeys()
    assert sorted(found) == [1, 2, 3, 4, 5]
    for number, (title, body, blocks) in found.items():
        first = body.strip().split("\n\n")[0]
        assert first.startswith("What you get:"), f"journey {number} ({title}) starts: {first}"
        assert blocks, f"journey {number} ({title}) has no bash block"


def test_journey_1_pretrains_the_tiny_model(tmp_path):
    run_journey(1, tmp_path)
    records = metrics(tmp_path / "runs" / "pretrain" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (tmp_path / "runs" / "pretrain" / "checkpoints" / "latest_iteration.txt").read_text(
    ).strip() == "4"


def test_journey_2_sft_from_hf_export_and_generate(tmp_path):
    done = run_journey(2, tmp_path)
    runs = tmp_path / "runs"
    assert [r["step"] for r in metrics(runs / "sft_run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert "eos ids: [285, 289, 291]" in done.stdout
    assert "generated:" in done.stdout
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "model.safetensors.index.json"):
        assert (runs / "hf_sft" / name).exists(), name
    # transformers loaded the export without reporting unexpected or missing tensors
    assert "UNEXPECTED" not in done.stdout + done.stderr
    assert "MISSING" not in done.stdout + done.stderr


def test_journey_3_resumes_a_run(tmp_path):
    done = run_journey(3, tmp_path)
    records = metrics(tmp_path / "runs" / "resume" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert done.stdout.strip().splitlines()[-1] == "8"


def test_journey_5_trains_rl_and_publishes_weights(tmp_path):
    done = run_journey(5, tmp_path)
    runs = tmp_path / "runs"
    records = metrics(runs / "rl" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("reward_mean", "rl_masked_fraction", "rl_dropped_rollouts", "rl_policy_lag",
                "rl_ratio_p50", "rl_entropy"):
        assert key in records[-1], key
    assert sorted(p.name for p in (runs / "published").iterdir()) == ["latest", "v0", "v2",
                                                                      "v4"]
    assert "latest loads: 4 (1, 3, 320)" in done.stdout


def test_journey_4_is_the_command_test_slurm_runs_and_fits_two_nodes():
    """The page's sbatch command is the one tests/test_slurm.py runs on its real two-node
    cluster (the README's); here it is also composed and planned for two 2-CPU nodes."""
    _, _, blocks = journeys()[4]
    joined = blocks[0].replace("\\\n", " ")
    command = shlex.split(next(line for line in joined.splitlines()
                               if line.startswith("sbatch ")))
    assert command == readme_sbatch_command()
    nodes = int(command[1].split("=")[1])
    tree = compose_tree(command[3:])
    par = parallel_config(OmegaConf.to_container(tree.parallel, resolve=True))
    plan = plan_processes(par, Allocation(nodes=nodes, gpus_per_node=0, cpus_per_node=2))
    assert (plan.nodes, plan.procs_per_node, plan.world_size) == (2, 2, 4)


if __name__ == "__main__":  # print a journey's script: python tests/test_journeys.py 2
    print("\n".join(journeys()[int(sys.argv[1])][2]))
