"""``--help`` for the launchers: what they do, the Hydra config groups, the keys most runs set.

The launchers hand every argument to Hydra as an override, so ``--help`` has to be caught before
any composing (Hydra would read it as a malformed override). The group list is read from
``configs/`` each time, so a new preset shows up without editing this file. Nothing here imports
torch, megatron-core or the job: ``--help`` answers at once and starts nothing.
"""

from __future__ import annotations

import os
import textwrap

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "configs")
HELP_FLAGS = ("-h", "--help")

# The keys most runs set (name, what it does). The defaults are in configs/; `--cfg job` on the
# training job prints the composed config in full.
COMMON_KEYS = (
    ("train.train_iters", "steps to train"),
    ("train.global_batch_size", "sequences per step (over all data-parallel ranks)"),
    ("train.micro_batch_size", "sequences per micro-batch"),
    ("train.seq_length", "tokens per sequence (chat SFT: the prepared --seq-length)"),
    ("train.lr / train.min_lr / train.warmup_iters", "learning-rate schedule"),
    ("parallel.data_parallel_size", "DP; processes = TP x PP x CP x DP"),
    ("parallel.tensor_model_parallel_size",
     "TP (also pipeline_, virtual_pipeline_, expert_, context_parallel_size)"),
    ("data.paths / data.tokenizer", "dataset prefixes and the tokenizer they were made with"),
    ("checkpoint.save / checkpoint.save_interval", "where and how often to save"),
    ("checkpoint.load", "auto (resume from checkpoint.save), a directory, or null"),
    ("hydra.run.dir", "the run directory (default outputs/<run id>)"),
)


def wants_help(argv: list[str]) -> bool:
    """-h / --help anywhere on the command line (Hydra overrides never look like that)."""
    return any(arg in HELP_FLAGS for arg in argv)


def default_options() -> dict[str, str]:
    """{group: option} from configs/config.yaml's defaults list."""
    with open(os.path.join(CONFIG_DIR, "config.yaml")) as f:
        defaults = yaml.safe_load(f).get("defaults", [])
    return {k: v for item in defaults if isinstance(item, dict) for k, v in item.items()}


def config_groups() -> dict[str, list[str]]:
    """{group: [option, ...]}: every directory of configs/ and the yaml files in it."""
    groups = {}
    for name in sorted(os.listdir(CONFIG_DIR)):
        path = os.path.join(CONFIG_DIR, name)
        if os.path.isdir(path):
            groups[name] = sorted(f[:-5] for f in os.listdir(path) if f.endswith(".yaml"))
    return groups


def groups_text() -> str:
    defaults = default_options()
    lines = []
    for group, options in config_groups().items():
        # experiment/ is not in the defaults list: Hydra adds it with a leading +
        key = group if group in defaults else f"+{group}"
        shown = [f"{o}*" if defaults.get(group) == o else o for o in options]
        lines.append(textwrap.fill(f"{key}=  {', '.join(shown)}", width=96,
                                   initial_indent="  ", subsequent_indent="        "))
    return "\n".join(lines)


def keys_text() -> str:
    width = max(len(k) for k, _ in COMMON_KEYS)
    return "\n".join(f"  {k:<{width}}  {what}" for k, what in COMMON_KEYS)


def launcher_help(usage: str, what: str, examples: list[str]) -> str:
    """The whole --help text of a launcher; ``examples`` are commands with a comment line."""
    return "\n".join([
        f"usage: {usage}",
        "",
        textwrap.fill(" ".join(what.split()), width=96),
        "",
        "Config groups (configs/<group>/<option>.yaml; * = default; pick one with group=option):",
        groups_text(),
        "",
        "Most used keys (any key of the composed config can be overridden: key=value):",
        keys_text(),
        "",
        "Examples:",
        *(f"  {line}" for line in "\n".join(examples).splitlines()),
        "",
    ])
