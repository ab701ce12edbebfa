"""Draw a run's expert load over MoE layers and steps, from its metrics.jsonl:

    python tools/draw_expert_load.py outputs/<run> [--layer layer_3] [--output load.png]

Left: max / mean tokens per expert, per MoE layer (rows, the MTP layers last) and step
(columns): 1 is a perfectly even split, E / top-k the most uneven possible (every token picks
the same k experts). Middle: one layer's tokens per expert over the steps, as a multiple of the
mean (the layer named by ``--layer``; default the worst layer at the last step). Right: that
layer's expert biases over the steps (runs with the expert bias; the bias moves each step by
model.moe_router_bias_update_rate towards the experts below the mean). Prints max / mean and the
coefficient of variation per layer at the first and last step. Needs matplotlib.

The fields are glm5_train/expert_load.py's (``expert_load``, ``expert_load_max_over_mean``,
``expert_load_cv``, ``expert_bias``); see docs/expert_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXAMPLES = r"""Examples:
  # the main job, then its expert load
  python -m launch.local train.train_iters=60 hydra.run.dir=outputs/main
  python tools/draw_expert_load.py outputs/main
  python tools/draw_expert_load.py outputs/main --layer mtp_0 --output mtp_load.png
"""


def read_records(run_dir: str) -> list[dict]:
    """The run's step records that carry expert load, in step order (the last of a redone
    step)."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                if "expert_load" in record:
                    by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def summary_lines(records: list[dict]) -> list[str]:
    """max / mean and CV per layer at the first and the last step."""
    first, last = records[0], records[-1]
    head = (f"{'layer':>8}  max/mean step {first['step']} -> {last['step']}   "
            f"CV step {first['step']} -> {last['step']}")
    lines = [head]
    for layer in first["expert_load"]:
        a, b = (r["expert_load_max_over_mean"][layer] for r in (first, last))
        c, d = (r["expert_load_cv"][layer] for r in (first, last))
        lines.append(f"{layer:>8}  {_num(a):>8} -> {_num(b):<8}     {_num(c):>6} -> {_num(d)}")
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def relative_load(records: list[dict], layer: str) -> list[list[float]]:
    """[expert][step]: tokens of each expert / the layer's mean tokens per expert."""
    columns = []
    for record in records:
        counts = record["expert_load"][layer]
        mean = sum(counts) / len(counts)
        columns.append([c / mean if mean else 0.0 for c in counts])
    return [list(row) for row in zip(*columns)]


def draw(records: list[dict], layer: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    layers = list(records[0]["expert_load"])
    steps = [r["step"] for r in records]
    ratio = [[r["expert_load_max_over_mean"][name] or 0.0 for r in records] for name in layers]
    biased = "expert_bias" in records[0]
    panels = 3 if biased else 2
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 1.6 + 0.3 * max(
        len(layers), len(records[0]["expert_load"][layer]))), squeeze=False)
    axes = axes[0]
    extent = (steps[0] - 0.5, steps[-1] + 0.5)
    image = axes[0].imshow(ratio, aspect="auto", cmap="magma_r", interpolation="nearest",
                           extent=(*extent, len(layers) - 0.5, -0.5))
    axes[0].set_yticks(range(len(layers)), layers)
    axes[0].set(xlabel="step", title="max / mean tokens per expert")
    figure.colorbar(image, ax=axes[0])
    load = relative_load(records, layer)
    experts = len(load)
    top = max(max(row) for row in load)
    image = axes[1].imshow(load, aspect="auto", cmap="RdBu_r", interpolation="nearest",
                           norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(top, 1.01)),
                           extent=(*extent, experts - 0.5, -0.5))
    axes[1].set(xlabel="step", ylabel="expert", title=f"{layer}: tokens / mean")
    figure.colorbar(image, ax=axes[1])
    if biased:
        bias = [list(row) for row in zip(*(r["expert_bias"][layer] for r in records))]
        reach = max(abs(v) for row in bias for v in row) or 1e-3
        image = axes[2].imshow(bias, aspect="auto", cmap="PuOr_r", interpolation="nearest",
                               vmin=-reach, vmax=reach, extent=(*extent, experts - 0.5, -0.5))
        axes[2].set(xlabel="step", ylabel="expert", title=f"{layer}: expert bias (after step)")
        figure.colorbar(image, ax=axes[2])
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory, or its metrics.jsonl")
    parser.add_argument("--layer", help="the layer of the per-expert panels (default: the "
                                        "worst at the last step)")
    parser.add_argument("--output", help="default: <run dir>/expert_load.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("tools/draw_expert_load.py needs matplotlib: pip install matplotlib"
                         ) from None
    records = read_records(args.run_dir)
    if not records:
        raise SystemExit(f"{args.run_dir}: no step record with expert_load (a model without "
                         "MoE layers, or a run from before expert load was logged)")
    layer = args.layer or records[-1].get("expert_load_worst_layer")
    if layer not in records[0]["expert_load"]:
        raise SystemExit(f"--layer {layer}: not an MoE layer of this run; its layers: "
                         f"{', '.join(records[0]['expert_load'])}")
    base = args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(args.run_dir)
    output = args.output or os.path.join(base, "expert_load.png")
    draw(records, layer, output)
    print("\n".join(summary_lines(records)))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
