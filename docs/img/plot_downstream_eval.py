"""Plot a run's in-loop downstream scores (`eval/<task>/<metric>` in its csv/metrics.csv) over training steps:
accuracies on the left axis, the cloze perplexity (log scale) on the right, val/loss for reference.

    python docs/img/plot_downstream_eval.py logs/train/runs/<run>/csv/metrics.csv docs/img/downstream_eval.png
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def main(csv_path: str, png_path: str) -> None:
    df = pd.read_csv(csv_path)
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted(k for k in df.columns if k.startswith("eval/") and "/acc" in k):
        rows = df.dropna(subset=[key]).drop_duplicates("step", keep="last")
        acc_ax.plot(rows["step"], rows[key], marker="o", label=key.removeprefix("eval/"))
    acc_ax.axhline(0.25, color="grey", linestyle=":", label="chance (choice)")
    acc_ax.set(xlabel="optimizer step", ylabel="accuracy", title="downstream accuracy, in the training loop")
    acc_ax.legend(fontsize=8)
    ppl = df.dropna(subset=["eval/parallama_cloze/perplexity"]).drop_duplicates("step", keep="last")
    loss_ax.plot(ppl["step"], ppl["eval/parallama_cloze/perplexity"], marker="o", color="C3", label="cloze word ppl")
    loss_ax.set(xlabel="optimizer step", ylabel="perplexity of the last word", yscale="log", title="cloze perplexity")
    val = df.dropna(subset=["val/ppl"]).drop_duplicates("step", keep="last")
    loss_ax.plot(val["step"], val["val/ppl"], marker=".", color="C7", label="val/ppl (per token)")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
