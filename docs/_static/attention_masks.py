"""Draws docs/_static/attention-masks.png: which keys each query row attends.

Run from the repository root: ``python docs/_static/attention_masks.py`` (needs
numpy and matplotlib). The masks follow step 4 of the attention formula
(docs/attention.md): causal and window limits on global positions, with
``query_offset``; sequence lengths; segment ids equal; the boolean mask.
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

T = S = 8
rows = np.arange(T)[:, None]
cols = np.arange(S)[None, :]
causal = cols <= rows
segments = np.array([0, 0, 0, 1, 1, 1, 1, 2])
boolean = np.ones((T, S), bool)
boolean[:, 1] = False

panels = [
    ("is_causal=True", causal, T),
    ("local_window_size=(2, 0)", (cols <= rows) & (cols >= rows - 2), T),
    ("is_causal, query_offset=4\n(4 new rows, 8 keys)", cols <= np.arange(4)[:, None] + 4, 4),
    ("key_value_seq_lengths=5", np.broadcast_to(cols < 5, (T, S)), T),
    ("segment ids 0 0 0 1 1 1 1 2\nwith is_causal", causal & (segments[:, None] == segments[None, :]), T),
    ("causal, lengths=5, segments, and\nmask[:, 1] = False: all ANDed",
     causal & (segments[:, None] == segments[None, :]) & (cols < 5) & boolean, T),
]

fig, axes = plt.subplots(2, 3, figsize=(8.4, 6.4))
for ax, (title, kept, t) in zip(axes.flat, panels):
  kept = np.asarray(kept)[:t]
  ax.imshow(kept, cmap="Blues", vmin=-0.3, vmax=1.0, aspect="equal")
  ax.set_title(title, fontsize=9)
  ax.set_xticks(range(S))
  ax.set_yticks(range(t))
  ax.set_yticklabels(range(8 - t, 8) if t < T else range(t))
  ax.tick_params(labelsize=6, length=0)
  ax.set_xticks(np.arange(-0.5, S), minor=True)
  ax.set_yticks(np.arange(-0.5, t), minor=True)
  ax.grid(which="minor", color="white", linewidth=1)
  ax.set_xlabel("key position j", fontsize=7)
for ax in axes[:, 0]:
  ax.set_ylabel("query position t (+ offset)", fontsize=7)
fig.tight_layout()
out = pathlib.Path(__file__).with_name("attention-masks.png")
fig.savefig(out, dpi=130)
print(out)
