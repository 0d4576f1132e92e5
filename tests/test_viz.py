import itertools

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import salt_jax  # noqa: E402
from salt_jax.agent.parsing import parse_action  # noqa: E402
from salt_jax.viz import action_label, layout_group, plot_trajectory_graph  # noqa: E402

TRUNK = [("go to desk 1", "You see a pen 1."), ("take pen 1", "You pick up the pen 1.")]
GROUP = [TRUNK + [("go to drawer 1", "It is closed.")], TRUNK + [("look", "A room.")],
         TRUNK + [("go to drawer 1", "It is closed."), ("open drawer 1", "It is open.")], []]
# A crowded group: a shared trunk, then six branches that split again, long actions, one response
# with its tags and one with a tag fragment left inside the parsed action.
CROWDED = [TRUNK + [(f"go to cabinet {i} and look for the pen on its top shelf", f"cab {i}"),
                    (f"open drawer {i % 2}", f"drawer {i}")] for i in range(6)]
CROWDED += [TRUNK + [("<think>hm</think><action>Examine Desk 1</action>", "A desk.")],
            TRUNK + [("take broomaction>take book from safe", "Nothing happens.")]]


def _plot(group, history=3, valid=None):
  m = salt_jax.build_merge_ids(group, [0] * len(group), history=history)
  before = np.repeat(np.linspace(-1.0, 1.0, len(group)), m.step_counts)
  after = np.asarray(salt_jax.refine(before, m.ids, m.num_segments))
  return m, plot_trajectory_graph(group, before, after, history=history, merge=m, valid=valid,
                                  title="a long title " * 8)


def _by_gid(fig, prefix):
  return {a.get_gid(): a for a in fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))}


def test_layout_has_one_edge_per_merge_id_with_multiplicities():
  m = salt_jax.build_merge_ids(GROUP, [0] * 4, history=2)
  lay = layout_group(GROUP, m, history=2)
  assert lay.edges.shape == (m.num_segments, 4)
  assert sorted(lay.edges[:, 2].tolist()) == list(range(m.num_segments))
  assert lay.edges[:, 3].sum() == m.num_steps
  mult = dict(zip(lay.edge_actions, lay.edges[:, 3].tolist()))
  assert mult["go to desk 1"] == 3 and mult["take pen 1"] == 3 and mult["go to drawer 1"] == 2
  # The root is the only node at depth 0 and every edge goes one step deeper.
  xy = lay.node_xy
  assert np.sum(xy[:, 0] == 0) == 1
  assert np.all(xy[lay.edges[:, 1], 0] == xy[lay.edges[:, 0], 0] + 1)


def test_action_label_is_the_parsed_action_without_tag_fragments():
  assert action_label("go to desk 1") == "go to desk 1"
  response = "<think>x</think><action>Go To  Desk 1</action>"
  assert action_label(response) == parse_action(response).action == "go to desk 1"
  assert action_label("take broomaction>take book") == "take broom…"
  assert action_label("take </act") == "take…"
  assert action_label("<action></action>") == action_label("") == "(no action)"
  assert action_label("action>") == "(no action)"


def test_labels_are_parsed_actions_and_the_numbers_on_edges_overlap_nothing():
  valid = np.array([a != CROWDED[-1][-1][0] for t in CROWDED for a, _ in t])
  m, fig = _plot(CROWDED, valid=valid)
  lay = layout_group(CROWDED, m, 3)
  # The table: one entry per edge, its text the parsed action; the invalid one in grey.
  actions = _by_gid(fig, "action:")
  cut = lambda s: s if len(s) <= 48 else s[:47] + "…"  # noqa: E731  (max_label_chars)
  assert {g: a.get_text() for g, a in actions.items()} == {
      f"action:{mid}": cut(action_label(act))
      for mid, act in zip(lay.edges[:, 2], lay.edge_actions)}
  assert any(a.get_text().endswith("top shelf") for a in actions.values()) is False
  assert {a.get_text() for a in actions.values()} >= {"go to desk 1", "examine desk 1",
                                                      "take broom…"}
  assert not any("action>" in a.get_text() for a in actions.values())
  greys = [a.get_text() for a in actions.values() if a.get_color() != "k"]
  assert greys == ["take broom…"]
  # The numbers on the edges: one per edge and panel, no two boxes overlap, none touches a title.
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  axes = fig.axes[:2]
  titles = [ax.title.get_window_extent(renderer) for ax in axes] + [
      fig._suptitle.get_window_extent(renderer)]  # pylint: disable=protected-access
  for ax in axes:
    labels = [t for t in ax.texts if (t.get_gid() or "").startswith("label:")]
    assert len(labels) == m.num_segments
    boxes = [t.get_window_extent(renderer) for t in labels]
    for a, b in itertools.combinations(boxes, 2):
      assert not a.overlaps(b)
    inside = ax.get_window_extent(renderer)
    for box in boxes:
      assert not any(box.overlaps(t) for t in titles)
      assert inside.x0 <= box.x0 and box.x1 <= inside.x1
      assert inside.y0 <= box.y0 and box.y1 <= inside.y1
  # The table's entries overlap neither each other nor the panels.
  table = [a.get_window_extent(renderer) for a in fig.axes[-1].texts]
  for a, b in itertools.combinations(table, 2):
    assert not a.overlaps(b)


def test_merged_edges_are_drawn_wider_than_single_ones_and_say_their_count():
  m, fig = _plot(GROUP)
  lay = layout_group(GROUP, m, 3)
  mult = {int(mid): int(k) for mid, k in zip(lay.edges[:, 2], lay.edges[:, 3])}
  edges = _by_gid(fig, "edge:")
  assert len(edges) == m.num_segments
  widths = {}
  for gid, arrow in edges.items():
    style = arrow.get_arrowstyle()
    widths[int(gid.split(":")[1])] = getattr(style, "tail_width", 0.0) * arrow.get_mutation_scale()
  merged = [mid for mid, k in mult.items() if k > 1]
  single = [mid for mid, k in mult.items() if k == 1]
  assert merged and single
  assert min(widths[i] for i in merged) > max(arrow.get_linewidth() for gid, arrow in edges.items()
                                              if int(gid.split(":")[1]) in single)
  assert widths[merged[0]] > 0 and all(widths[i] == 0.0 for i in single)
  # Wider with more members; the number on a merged edge of the right panel says "×k".
  three = [i for i in merged if mult[i] == 3]
  two = [i for i in merged if mult[i] == 2]
  assert widths[three[0]] > widths[two[0]]
  right = {t.get_gid(): t.get_text() for t in fig.axes[1].texts}
  for mid in merged:
    assert right[f"label:{mid}"].endswith(f"×{mult[mid]}")
  for mid in single:
    assert "×" not in right[f"label:{mid}"]
  # Before SALT every step is its own strand.
  assert len(fig.findobj(lambda a: (a.get_gid() or "").startswith("strand:"))) == m.num_steps


def test_plot_checks_its_inputs():
  m = salt_jax.build_merge_ids(GROUP, [0] * 4, history=3)
  before = np.repeat(np.array([1.0, -1.0, 0.5, 0.0]), m.step_counts)
  with pytest.raises(ValueError, match="advantages"):
    plot_trajectory_graph(GROUP, before[:-1], before, history=3)
  with pytest.raises(ValueError, match="valid"):
    plot_trajectory_graph(GROUP, before, before, history=3, valid=[True])
  with pytest.raises(ValueError, match="step count"):
    layout_group(GROUP[:2], m, history=3)
