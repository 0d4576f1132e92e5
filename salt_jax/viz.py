"""A picture of one group's trajectory graph, before and after SALT (host side, matplotlib).

Nodes are states (the last h (action, observation) pairs, the root being the task); edges are
actions. Steps that SALT merged are drawn as one edge labelled with its multiplicity, so the shared
trunk and the divergent branches of a group are visible at a glance, and the edge colour shows the
advantage before (left) and after (right) refinement. Edges carry numbers, placed where they overlap
no other label; a table under the panels gives each number's action, as the action parser reads it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import numpy as np

from salt_jax.agent import parsing
from salt_jax.agent.parsing import normalize_action, parse_action
from salt_jax.graph import MergeIds, build_merge_ids

# What a model may leave of its tags inside an action: "<act", "</action", "action>", "ion>", ...
_TAG_FRAGMENT = re.compile(r"</?[a-z]*>?|/?(?:a?c?t?i?o?n)>")


@dataclasses.dataclass(frozen=True)
class GraphLayout:
  """Nodes and merged edges of one group's graph, with positions for drawing.

  node_xy: float[num_nodes, 2] (x = depth, i.e. step index; y = slot within the depth).
  edges: one row per merged edge: (source node, target node, merge id, multiplicity).
  edge_actions: the action text of each edge.
  """

  node_xy: np.ndarray
  edges: np.ndarray
  edge_actions: list[str]


def layout_group(trajectories: Sequence[Sequence[tuple[str, str]]], merge: MergeIds,
                 history: int) -> GraphLayout:
  """Nodes = distinct (depth-free) states, one edge per merge id, laid out by first depth seen.

  Args:
    trajectories: the group's trajectories, (action, observation) pairs.
    merge: `build_merge_ids(trajectories, [g] * len(trajectories), history=history)`.
    history: the h the merge ids were built with.
  """
  if merge.num_steps != sum(len(t) for t in trajectories):
    raise ValueError("merge ids do not match the trajectories' step count")
  nodes: dict = {}
  depth: dict = {}
  edge_rows: dict = {}
  k = 0
  for traj in trajectories:
    for t, (action, obs) in enumerate(traj):
      src = tuple(traj[max(0, t - history):t])
      dst = tuple(traj[max(0, t + 1 - history):t + 1])
      for node, d in ((src, t), (dst, t + 1)):
        if node not in nodes:
          nodes[node] = len(nodes)
          depth[nodes[node]] = d
      mid = int(merge.ids[k])
      if mid in edge_rows:
        edge_rows[mid][3] += 1
      else:
        edge_rows[mid] = [nodes[src], nodes[dst], mid, 1, action]
      k += 1
  xy = np.zeros((len(nodes), 2))
  per_depth: dict = {}
  for node_id in range(len(nodes)):
    d = depth[node_id]
    xy[node_id] = (d, per_depth.get(d, 0))
    per_depth[d] = per_depth.get(d, 0) + 1
  for node_id in range(len(nodes)):  # centre each column
    xy[node_id, 1] -= (per_depth[depth[node_id]] - 1) / 2
  rows = list(edge_rows.values())
  edges = np.array([r[:4] for r in rows], np.int64).reshape(-1, 4)
  return GraphLayout(xy, edges, [r[4] for r in rows])


def action_label(text: str) -> str:
  """An edge's label: the action `parse_action` reads from `text`, cut before any tag fragment.

  `text` is a model response (with `<action>` tags) or an action already parsed. A parsed action
  can still hold what a small model wrote around its tags ("take broomaction>take book ..."): the
  label keeps what comes before the fragment and ends with "…". "(no action)" when nothing parses.
  """
  if parsing.OPEN_TAG in text.lower():
    action = parse_action(text).action
  else:
    action = normalize_action(text)
  head, *rest = _TAG_FRAGMENT.split(action, maxsplit=1)
  if rest:
    return head.strip() + "…" if head.strip() else "(no action)"
  return action or "(no action)"


def _edge_order(lay: GraphLayout) -> np.ndarray:
  """Edges sorted by the depth and height of their source, then of their target: keys 1, 2, ..."""
  src, dst = lay.node_xy[lay.edges[:, 0]], lay.node_xy[lay.edges[:, 1]]
  return np.lexsort((-dst[:, 1], -src[:, 1], src[:, 0]))


def _place_labels(ax, labels, segments) -> None:
  """Moves each label along its edge (then off it) to the first spot where its box overlaps no
  label placed before it and stays inside the axes (the fewest overlaps when none is free)."""
  renderer = ax.figure.canvas.get_renderer()
  inside = ax.get_window_extent(renderer)
  pad = 2.0  # pixels kept free around each label
  taken = []
  for text, ((x0, y0), (x1, y1)) in zip(labels, segments):
    best = None
    for frac in (0.5, 0.35, 0.65, 0.2, 0.8):
      for dy in (0.0, 0.18, -0.18, 0.36, -0.36):
        text.set_position((x0 + frac * (x1 - x0), y0 + frac * (y1 - y0) + dy))
        box = text.get_window_extent(renderer).padded(pad)
        hits = sum(box.overlaps(b) for b in taken)
        hits += 0 if (inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)) else 1
        if best is None or hits < best[0]:
          best = (hits, text.get_position(), box)
        if hits == 0:
          break
      if best[0] == 0:
        break
    text.set_position(best[1])
    taken.append(best[2])


def plot_trajectory_graph(trajectories, advantages_before, advantages_after, *, history: int = 3,
                          merge: Optional[MergeIds] = None, title: str = "", valid=None,
                          max_label_chars: int = 48):
  """Draw one group's trajectory graph, coloured by advantage before and after SALT.

  Each edge carries a number; the table under the panels gives its action (`action_label`). Left:
  one thin strand per step, coloured by its trajectory's advantage. Right: one arrow per edge,
  coloured by the refined advantage; an edge that merged k > 1 steps is thick (width grows with k)
  and its number says "×k".

  Args:
    trajectories: the group's trajectories, each a sequence of (action, observation) pairs.
    advantages_before: f32[N] per-step advantages before SALT (trajectory-major).
    advantages_after: f32[N] the refined advantages.
    history: h used for the graph.
    merge: merge ids for the group (computed when None).
    title: figure title.
    valid: optional bool[N], whether each step was a valid action; an edge with an invalid step
      has its action in grey italics.
    max_label_chars: actions in the table are cut to this length.
  Returns:
    The matplotlib Figure. Its artists carry gids: "edge:<merge id>" (right-panel arrows),
    "strand:<merge id>" (left), "label:<merge id>" (the numbers on the edges), "action:<merge id>"
    (the table's actions).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import colors, patches  # pylint: disable=import-outside-toplevel

  if merge is None:
    merge = build_merge_ids(trajectories, [0] * len(trajectories), history=history)
  before = np.asarray(advantages_before, np.float64).reshape(-1)
  after = np.asarray(advantages_after, np.float64).reshape(-1)
  if before.shape != (merge.num_steps,) or after.shape != (merge.num_steps,):
    raise ValueError(f"need {merge.num_steps} advantages before and after, got {before.shape} and "
                     f"{after.shape}")
  step_valid = np.ones(merge.num_steps, bool) if valid is None else np.asarray(valid, bool)
  if step_valid.shape != (merge.num_steps,):
    raise ValueError(f"valid must have shape ({merge.num_steps},), got {step_valid.shape}")
  lay = layout_group(trajectories, merge, history)
  order = _edge_order(lay)
  key = {int(lay.edges[e, 2]): n + 1 for n, e in enumerate(order)}
  edge_valid = np.ones(merge.num_segments, bool)
  np.logical_and.at(edge_valid, merge.ids, step_valid)
  lim = max(1e-6, float(np.max(np.abs(np.concatenate([before, after])))) if before.size else 1.0)
  norm = colors.TwoSlopeNorm(vmin=-lim, vcenter=0.0, vmax=lim)
  cmap = matplotlib.colormaps["coolwarm_r"]

  ncol = 1 if len(order) <= 4 else 2 if len(order) <= 16 else 3
  table_rows = -(-len(order) // ncol)
  height = 4.5 + 0.22 * table_rows
  fig = plt.figure(figsize=(14, height))
  grid = fig.add_gridspec(2, 3, width_ratios=[1, 1, 0.04], height_ratios=[4.5, 0.22 * table_rows],
                          hspace=0.25, wspace=0.08)
  axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
  axes[1].sharey(axes[0])
  table = fig.add_subplot(grid[1, :])
  table.set_axis_off()
  xy = lay.node_xy
  placed = []
  for ax, values, name in ((axes[0], before, "before SALT"), (axes[1], after, "after SALT")):
    labels, segments = [], []
    for e in order:
      src, dst, mid, mult = (int(v) for v in lay.edges[e])
      (x0, y0), (x1, y1) = xy[src], xy[dst]
      if name == "before SALT":  # one strand per member, each its trajectory's advantage
        members = values[merge.ids == mid]
        offsets = (np.arange(mult) - (mult - 1) / 2) * min(0.05, 0.3 / max(mult, 1))
        for v, off in zip(members, offsets):
          ax.add_patch(patches.FancyArrowPatch(
              (x0, y0 + off), (x1, y1 + off), arrowstyle="-|>", mutation_scale=9,
              color=cmap(norm(v)), lw=1.0, shrinkA=4, shrinkB=4, gid=f"strand:{mid}"))
        text = str(key[mid])
      else:
        colour = cmap(norm(values[merge.ids == mid].mean()))
        ends = dict(shrinkA=4, shrinkB=4)
        if mult > 1:  # a filled band with a dark outline, as wide as its member count
          style = patches.ArrowStyle.Simple(head_length=0.6, head_width=0.5 + 0.12 * min(mult, 12),
                                            tail_width=0.12 * min(mult, 12))
          arrow = patches.FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=20,
                                          fc=colour, ec="0.15", lw=0.8, zorder=2, **ends)
        else:
          arrow = patches.FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=9,
                                          color=colour, lw=1.0, zorder=1, **ends)
        arrow.set_gid(f"edge:{mid}")
        ax.add_patch(arrow)
        text = f"{key[mid]} ×{mult}" if mult > 1 else str(key[mid])
      labels.append(ax.text(x0, y0, text, fontsize=8, ha="center", va="center", zorder=5,
                            fontweight="bold" if mult > 1 and name == "after SALT" else "normal",
                            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none",
                                      alpha=0.85), gid=f"label:{mid}"))
      segments.append(((x0, y0), (x1, y1)))
    ax.scatter(xy[:, 0], xy[:, 1], s=14, c="k", zorder=3)
    if len(xy):
      ax.scatter([0], [xy[0, 1]], s=60, c="gold", edgecolors="k", zorder=4, label="task start")
    ax.set_title(f"{name} (merge rate {merge.merge_rate:.2f})" if name == "after SALT" else name)
    ax.set_xlabel("step")
    ax.set_yticks([])
    if len(xy):
      ax.set_xlim(-0.3, xy[:, 0].max() + 0.3)
      ax.set_ylim(xy[:, 1].min() - 0.6, xy[:, 1].max() + 0.6)
    placed.append((ax, labels, segments))
  fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), cax=fig.add_subplot(grid[0, 2]),
               label="advantage")
  if title:
    fig.suptitle(title)
  for ax, labels, segments in placed:  # the layout is final: put the numbers where they fit
    _place_labels(ax, labels, segments)
  for n, e in enumerate(order):
    mid, mult = int(lay.edges[e, 2]), int(lay.edges[e, 3])
    x, y = (n // table_rows) / ncol + 0.02, 1.0 - (n % table_rows + 0.5) / table_rows
    table.text(x, y, f"{key[mid]}", fontsize=8, fontweight="bold", ha="right", va="center",
               transform=table.transAxes)
    label = action_label(lay.edge_actions[e])
    if len(label) > max_label_chars:
      label = label[:max_label_chars - 1] + "…"
    table.text(x + 0.008, y, label, fontsize=8, ha="left", va="center", transform=table.transAxes,
               color="k" if edge_valid[mid] else "0.45",
               fontstyle="normal" if edge_valid[mid] else "italic", gid=f"action:{mid}")
  if not edge_valid.all():
    table.text(1.0, 0.0, "grey italics: an invalid action", fontsize=7, color="0.45",
               fontstyle="italic", ha="right", va="bottom", transform=table.transAxes)
  return fig
