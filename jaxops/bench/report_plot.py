"""The report's plot: per platform, jaxops' speed-up over the fastest peer of
each row of the report's table, as horizontal bars on a log scale.

matplotlib is optional (the ``bench`` extra): without it ``write`` says why
the plot was skipped instead of failing the report.
"""

from __future__ import annotations

_BAR_INCHES = 0.16


def _op_name(row: dict) -> str:
  """The op, after its family's name unless the op's name starts with it."""
  if row["op"].startswith(row["family"]):
    return row["op"]
  return f"{row['family']}: {row['op']}"


def write(platform_rows: dict[str, list[dict]], path: str) -> str | None:
  """Writes the PNG at ``path``; returns None, or the reason it was skipped."""
  try:
    import matplotlib
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed (pip install 'jaxops[bench]')"
  platforms = [(title, rows) for title, rows in platform_rows.items() if rows]
  if not platforms:
    return "no result has a peer to compare with"
  heights = [max(2.0, 0.8 + _BAR_INCHES * len(rows)) for _, rows in platforms]
  figure, axes = plt.subplots(len(platforms), 1, figsize=(11, sum(heights)),
                              gridspec_kw={"height_ratios": heights}, squeeze=False)
  for axis, (title, rows) in zip(axes[:, 0], platforms):
    labels = [f"{_op_name(r)} {r['dtype']} {r['pass']}" for r in rows]
    values = [r["fastest"] for r in rows]
    positions = range(len(rows))
    axis.barh(positions, values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    axis.set_yticks(list(positions), labels, fontsize=6)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("speed-up over the fastest peer (geometric mean over shapes; log scale)")
    axis.set_title(title, fontsize=9)
    axis.grid(axis="x", which="both", linewidth=0.3)
  figure.tight_layout()
  figure.savefig(path, dpi=110, bbox_inches="tight")  # never crop the longest labels
  plt.close(figure)
  return None
