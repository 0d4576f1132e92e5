"""WebShop's text environment (princeton-nlp/WebShop, `web_agent_text_env.py`), as verl-agent
drives it, on WebShop's own data files, in pure Python (no Java, no Lucene index, no Flask).

Data: a folder holding WebShop's three files, in WebShop's schema:
  items_shuffle_1000.json  the products (asin, name, query, category, product_category, pricing,
                           full_description, small_description, customization_options, images)
  items_ins_v2_1000.json   asin -> {attributes, instruction, instruction_attributes}
  items_human_ins.json     asin -> [{instruction, instruction_attributes, instruction_options}]
The folder is, in order: the `data_dir` argument, `$WEBSHOP_DATA`, else the fixture shipped in
`envs/webshop_data/fixture/` (made by `envs/webshop_data/make_fixture.py`). Products are loaded as
WebShop's `load_products` loads them (no reviews file: WebShop's current loader reads none). Goals
are WebShop's `get_goals`: synthetic ones (one per option combination of each product with an
instruction; verl-agent's `human_goals: False`) or human ones (`human_goals=True`), shuffled with
WebShop's `random.seed(233)`, so goal i is WebShop's goal i. Split as verl-agent: goals 0-499 are
"test", the rest "train"; a catalog with at most 2,500 goals (the fixture) keeps its first fifth for
"test" instead. WebShop draws prices and price caps from the unseeded global `random`; here they
come from `random.Random(price_seed)`: reproducible (and different from any one WebShop run).

Pages and actions are WebShop's: the search page; results, 10 a page, ranked by BM25 (`bm25s`,
Lucene's k1 = 0.9, b = 0.4 and IDF, Lucene's English stop words, the Porter stemmer) over the text
WebShop indexes (title, description, first bullet point, options), at most 50 hits; item pages with
their option buttons; the Description / Features / Reviews sub-pages; `search[query]` and
`click[button]`; `click[buy now]` ends the episode with WebShop's score (`envs.webshop_reward`).
Observations are WebShop's `observation_mode='text'` ("simple"): the page's visible texts joined
by " [SEP] ". Available actions are verl-agent's list: `search[<your query>]` where the page has a
search bar, then `click[x]` for every clickable. As in WebShop, a search typed on a page without a
search bar is played too, a blank query finds nothing, and `click[search]` is listed but does
nothing. An action WebShop ignores is an invalid step that re-shows the page. The page after
buying shows only the thank-you line and the score (WebShop's done page also prints hidden
debugging fields).

Reward: `reward="won"` (default, verl-agent's): 1.0 for a perfect purchase (score 1.0), else 0.0;
`reward="score"`: WebShop's score. `won` is score == 1.0 either way; `last_score` holds the score.
Episodes end on buying or after `max_steps` (15, verl-agent's WebShop runs).

CLI (the scripted expert: searches the goal product's title, opens it, picks the goal's options,
buys):
  python -m envs.webshop --expert --num-tasks 20
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import functools
import itertools
import json
import os
import pathlib
import random
import re
import time
from typing import Any, Optional, Sequence

from envs.base import AdmissibleCommandEnv, EnvStep, Task, normalize_action
from envs import webshop_reward

DATA_FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json")
FIXTURE_DIR = pathlib.Path(__file__).parent / "webshop_data" / "fixture"
SPLITS = ("train", "test")
TEST_GOALS = 500  # verl-agent: goals 0-499 test, 500- train
SEARCH_RETURN_N = 50  # WebShop's hits per search
PRODUCT_WINDOW = 10  # results per page
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price caps
GOAL_SHUFFLE_SEED = 233
REWARDS = ("won", "score")
SEP = " [SEP] "
SEARCH_TEMPLATE = "search[<your query>]"  # verl-agent's listing of the search bar
# Buttons, as WebShop's pages label them (clicked lower-cased).
BACK_TO_SEARCH, PREV, NEXT, BUY = "Back to Search", "< Prev", "Next >", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")
LUCENE_STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with".split())
_ACTION = re.compile(r"(.+)\[(.+)\]")  # WebShop's engine.parse_action

# The agent's prompt pieces for WebShop (`envs.registry.prompt_fields`, read by
# `salt_jax.agent.prompts.env_prompt_config`): an instruction, and the view of the pages below.
INSTRUCTION = (
    "You are an expert autonomous agent shopping in the WebShop e-commerce environment. Each turn "
    "you see the current web page, its texts separated by [SEP], and the actions available on it; "
    "search[...] takes any query. Choose the action that best advances the shopping goal.")
PROMPT = {"instruction": INSTRUCTION, "observation_view": "webshop"}


def observation_view(first_observation: str, observation: str) -> tuple[str, str]:
  """(task, page) of a WebShop text observation, as verl-agent's WebShop manager shows them.

  The task is the text after "Instruction:" in the first page; the page is what follows the task,
  each text quoted ("'Back to Search' [SEP] 'Page 1 (Total results: 50)' ..."). A page that does
  not hold the task (the page after buying) is shown as it is. A first page without an
  "Instruction:" text is its own task.
  """
  parts = first_observation.split(SEP)
  task = (parts[parts.index("Instruction:") + 1] if "Instruction:" in parts[:-1]
          else first_observation)
  page = observation.split(SEP)
  if task not in page:
    return task, observation
  return task, SEP.join(f"'{p}'" for p in page[page.index(task) + 1:])


# ---------------------------------------------------------------------------------------------
# Data: WebShop's schema in, WebShop's product and goal dicts out.


def resolve_data_dir(data_dir: Optional[str] = None) -> pathlib.Path:
  """The data folder: `data_dir`, else `$WEBSHOP_DATA`, else the shipped fixture.

  Raises FileNotFoundError naming the missing files of a folder that lacks any of `DATA_FILES`.
  """
  root = pathlib.Path(data_dir or os.environ.get("WEBSHOP_DATA") or FIXTURE_DIR).expanduser()
  missing = [f for f in DATA_FILES if not (root / f).is_file()]
  if missing:
    raise FileNotFoundError(f"WebShop data folder {root} lacks {missing}")
  return root


def parse_pricing(pricing: Any) -> tuple[list[float], str]:
  """WebShop's price parsing: ("$12.99" or "$10.00 - $20.00" or empty) -> (prices, price tag)."""
  if not pricing:
    return [100.0], "$100.0"
  try:
    prices = [float(decimal.Decimal(re.sub(r"[^\d.]", "", p)))
              for p in str(pricing).split("$")[1:]]
  except decimal.InvalidOperation:
    prices = []
  if not prices:
    raise ValueError(f"unparseable pricing {pricing!r} (expected '$12.99' or '$10.00 - $20.00')")
  if len(prices) == 1:
    return prices, f"${prices[0]}"
  return prices[:2], f"${prices[0]} to ${prices[1]}"


def load_products(items: Sequence[dict], attributes: dict, human_instructions: dict,
                  human_goals: bool) -> list[dict]:
  """WebShop's `load_products`: the raw items as product dicts (asins 'nan' or longer than 10
  characters and repeats dropped), with Title, Description, BulletPoints, Price, pricing,
  options (name -> lower-cased values, '/' shown as ' | '), Attributes (['DUMMY_ATTR'] if none),
  Reviews (none), Rating 'N.A.', and the goal sources: `instructions` (human) or
  `instruction_text` / `instruction_attributes` (synthetic)."""
  seen, products = set(), []
  for raw in items:
    asin = str(raw.get("asin", "nan"))
    if asin == "nan" or len(asin) > 10 or asin in seen:
      continue
    seen.add(asin)
    p = {k: raw[k] for k in ("asin", "category", "name", "product_category")}
    p["query"] = str(raw["query"]).lower().strip()
    p["Title"] = raw["name"]
    p["Description"] = raw.get("full_description") or ""
    small = raw.get("small_description")
    p["BulletPoints"] = small if isinstance(small, list) else [small or ""]
    p["Reviews"], p["Rating"] = [], "N.A."
    p["pricing"], p["Price"] = parse_pricing(raw.get("pricing"))
    options = {}
    for name, contents in (raw.get("customization_options") or {}).items():
      if contents is not None:
        options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    p["options"] = options
    attrs = attributes.get(asin) or {}
    p["Attributes"] = attrs.get("attributes") or ["DUMMY_ATTR"]
    if human_goals:
      if asin in human_instructions:
        p["instructions"] = human_instructions[asin]
    else:
      p["instruction_text"] = attrs.get("instruction")
      p["instruction_attributes"] = attrs.get("instruction_attributes")
    p["MainImage"] = (raw.get("images") or [""])[0]
    products.append(p)
  return products


def product_prices(products: Sequence[dict], rng: random.Random) -> dict:
  """WebShop's `generate_product_prices`: the one price, or a uniform draw between the two."""
  out = {}
  for p in products:
    pricing = p["pricing"]
    out[p["asin"]] = pricing[0] if len(pricing) == 1 else rng.uniform(*pricing[:2])
  return out


def _price_cap(price: float, rng: random.Random) -> tuple[float, str]:
  caps = [c for c in PRICE_RANGE if c > price][:4]
  if len(caps) < 2:
    return 1000000, ""
  _, upper = sorted(rng.sample(caps, 2))
  return upper, f", and price lower than {upper:.2f} dollars"


def make_goals(products: Sequence[dict], prices: dict, human_goals: bool,
               rng: random.Random) -> list[dict]:
  """WebShop's `get_goals` (human or synthetic), then its shuffle with seed 233.

  Each goal: asin, category, query, name, product_category, instruction_text, attributes,
  price_upper, goal_options (a list of values for human goals, a dict name -> value for synthetic
  ones), weight.
  """
  goals = []
  for p in products:
    base = {k: p[k] for k in ("asin", "category", "query", "name", "product_category")}
    if human_goals:
      for ins in p.get("instructions", []):
        if not ins.get("instruction_attributes"):
          continue
        upper, price_text = _price_cap(prices[p["asin"]], rng)
        goals.append(dict(base, instruction_text=ins["instruction"].strip(".") + price_text,
                          attributes=ins["instruction_attributes"], price_upper=upper,
                          goal_options=ins.get("instruction_options", []), weight=1))
      continue
    if not p.get("instruction_text") or not p.get("instruction_attributes"):
      continue
    upper, price_text = _price_cap(prices[p["asin"]], rng)
    names = sorted(p["options"])
    for combo in itertools.product(*(p["options"][n] for n in names)):
      chosen = dict(zip(names, combo))
      option_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
      option_text = " with " + option_text if option_text else ""
      goals.append(dict(base, name=p["Title"],
                        instruction_text=f"{p['instruction_text']}{option_text}{price_text}",
                        attributes=p["instruction_attributes"], price_upper=upper,
                        goal_options=chosen))
  if not human_goals:
    count = {}
    for g in goals:
      for a in g["attributes"]:
        count[a] = count.get(a, 0) + 1
    for g in goals:
      g["weight"] = sum(1.0 / count[a] for a in g["attributes"]) / len(g["attributes"])
  random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
  return goals


def search_document(p: dict) -> str:
  """The text WebShop indexes for a product: title, description, first bullet point and the
  options ("name: v1, v2, and name: ..."), lower-cased."""
  option_text = ", and ".join(f"{n}: {', '.join(v)}" for n, v in p["options"].items())
  first_bullet = p["BulletPoints"][0] if p["BulletPoints"] else ""
  return " ".join([p["Title"], p["Description"], first_bullet or "", option_text]).lower()


class SearchEngine:
  """BM25 over the products' search documents, as WebShop's Lucene index ranks them.

  Lucene's English analysis approximated: lower-case, possessive 's dropped, word tokens, Lucene's
  33 stop words removed, Porter stems (PyStemmer). Ties keep catalog order.
  """

  def __init__(self, products: Sequence[dict]):
    try:
      import bm25s  # pylint: disable=import-outside-toplevel
      import Stemmer  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("WebShop search needs bm25s and PyStemmer: pip install 'salt-jax[webshop]'"
                        ) from e
    self._stem = Stemmer.Stemmer("porter").stemWords
    self.asins = [p["asin"] for p in products]
    self._bm25 = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
    self._bm25.index([self.tokens(search_document(p)) or ["_"] for p in products],
                     show_progress=False)

  def tokens(self, text: str) -> list[str]:
    """The index terms of `text` (possibly none)."""
    words = re.findall(r"\w+", re.sub(r"'s\b", "", str(text).lower()))
    return self._stem([w for w in words if w not in LUCENE_STOPWORDS])

  def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[str]:
    """The asins of the (at most k) products matching `query`, best first; [] for no match."""
    terms = [t for t in self.tokens(query) if t in self._bm25.vocab_dict]
    if not terms:
      return []
    scores = self._bm25.get_scores(terms)
    order = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
    return [self.asins[i] for i in order[:k]]


@dataclasses.dataclass
class Catalog:
  """One data folder loaded: products (catalog order), by_asin, prices, goals, search engine."""

  root: pathlib.Path
  products: list
  by_asin: dict
  prices: dict
  goals: list
  human_goals: bool

  @functools.cached_property
  def engine(self) -> SearchEngine:
    return SearchEngine(self.products)

  @property
  def num_test(self) -> int:
    return TEST_GOALS if len(self.goals) > 5 * TEST_GOALS else len(self.goals) // 5

  def split_indices(self, split: str) -> range:
    if split not in SPLITS:
      raise ValueError(f"unknown WebShop split {split!r}; expected one of {SPLITS}")
    return range(self.num_test) if split == "test" else range(self.num_test, len(self.goals))


@functools.lru_cache(maxsize=4)
def _load_catalog(root: str, stamp: tuple, human_goals: bool, price_seed: int) -> Catalog:
  del stamp  # part of the cache key only: a rewritten file is read again
  path = pathlib.Path(root)
  items, attributes, human = (json.loads((path / f).read_text(encoding="utf-8"))
                              for f in DATA_FILES)
  products = load_products(items, attributes, human, human_goals)
  if not products:
    raise ValueError(f"no products in {path / DATA_FILES[0]}")
  rng = random.Random(price_seed)
  prices = product_prices(products, rng)
  goals = make_goals(products, prices, human_goals, rng)
  return Catalog(path, products, {p["asin"]: p for p in products}, prices, goals, human_goals)


def load_catalog(data_dir: Optional[str] = None, human_goals: bool = False,
                 price_seed: int = 0) -> Catalog:
  """The catalog of a data folder (see `resolve_data_dir`), cached per process."""
  root = resolve_data_dir(data_dir)
  stamp = tuple((root / f).stat().st_mtime_ns for f in DATA_FILES)
  return _load_catalog(str(root.resolve()), stamp, bool(human_goals), int(price_seed))


def _task_prefix(human_goals: bool) -> str:
  return f"webshop-{'human' if human_goals else 'synth'}-"


def webshop_tasks(split: str = "train", data_dir: Optional[str] = None, human_goals: bool = False,
                  num_tasks: Optional[int] = None, price_seed: int = 0) -> list[Task]:
  """The goals of `split` ("train" or "test") as tasks, in goal order.

  Task ids are "webshop-synth-<goal index>" (or "-human-"); the task type is the goal's category.
  """
  cat = load_catalog(data_dir, human_goals, price_seed)
  idx = cat.split_indices(split)
  idx = idx[:num_tasks] if num_tasks is not None else idx
  return [Task(task_id=f"{_task_prefix(human_goals)}{i}", task_type=cat.goals[i]["category"],
               split=split) for i in idx]


# ---------------------------------------------------------------------------------------------
# Pages: what WebShop's HTML templates show, as the text mode reads them.


def _visible(texts: Sequence[str]) -> list[str]:
  """The texts BeautifulSoup's text mode keeps: a text node exists only when non-empty, one of
  whitespace with a newline is dropped, every other one is stripped (a lone space leaves '')."""
  return [t.strip() for t in texts if t and not (not t.strip() and "\n" in t)]


@dataclasses.dataclass
class Page:
  """One page: its kind (search, results, item, description, features, reviews, done), its texts
  in document order, whether it has the search bar, and its clickables (lower-cased text -> the
  click's meaning: ('button', label) / ('product', asin) / ('option', (name, value)))."""

  kind: str
  texts: list
  has_search_bar: bool = False
  clickables: dict = dataclasses.field(default_factory=dict)

  def observation(self) -> str:
    return SEP.join(_visible(self.texts))

  def available_actions(self) -> tuple[str, ...]:
    """verl-agent's list: the search template where there is a search bar, then the clicks."""
    head = (SEARCH_TEMPLATE,) if self.has_search_bar else ()
    return head + tuple(f"click[{c}]" for c in self.clickables)


def _buttons(*labels: str) -> dict:
  return {label.lower(): ("button", label) for label in labels}


@dataclasses.dataclass
class _Session:
  """WebShop's per-session state: the current page and what led to it."""

  page: str = "search"
  keywords: list = dataclasses.field(default_factory=list)
  page_num: int = 1
  results: list = dataclasses.field(default_factory=list)  # all asins of the last search
  asin: Optional[str] = None
  options: dict = dataclasses.field(default_factory=dict)
  score: Optional[float] = None


def render(session: _Session, goal: dict, catalog: Catalog) -> Page:
  """The page `session` is on."""
  instr = goal["instruction_text"]
  head = ["Instruction:", instr, BACK_TO_SEARCH]
  kind = session.page
  if kind == "search":
    return Page(kind, ["WebShop", "Instruction: ", instr, "Search"], True, _buttons("Search"))
  if kind == "results":
    n = session.page_num
    shown = session.results[(n - 1) * PRODUCT_WINDOW:n * PRODUCT_WINDOW]
    nav = ([PREV] if n > 1 else []) + [NEXT]
    texts = head + [f"Page {n} (Total results: {len(session.results)})"] + nav
    clicks = _buttons(BACK_TO_SEARCH, *nav)
    for asin in shown:
      p = catalog.by_asin[asin]
      texts += [asin, p["Title"], p["Price"]]
      clicks.setdefault(asin.lower(), ("product", asin))
    return Page(kind, texts, False, clicks)
  p = catalog.by_asin[session.asin]
  if kind == "item":
    texts = head + [PREV]
    option_clicks = {}
    for name, values in p["options"].items():
      texts += [name, *values]
      for v in values:
        option_clicks[v] = ("option", (name, v))
    texts += [p["Title"], f"Price: {p['Price']}", f"Rating: {p['Rating']}", *SUB_PAGES, BUY]
    clicks = _buttons(BACK_TO_SEARCH, PREV, *SUB_PAGES, BUY)
    clicks.update(option_clicks)
    return Page(kind, texts, False, clicks)
  if kind == "done":
    return Page(kind, ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)",
                       str(session.score)])
  body = {"description": [p["Description"]],
          "features": [f" {b}" for b in p["BulletPoints"]],
          "reviews": [t for r in p["Reviews"] for t in (f'"{r.get("title", "")}"',
                                                        str(r.get("score", "")),
                                                        r.get("body", ""))]}[kind]
  return Page(kind, head + [PREV] + body, False, _buttons(BACK_TO_SEARCH, PREV))


# ---------------------------------------------------------------------------------------------
# The environment.


def parse_webshop_action(action: Any) -> tuple[str, Optional[str]]:
  """WebShop's `parse_action` on the normalized action: ("search", "red shoes") for
  "search[red shoes]"; (action, None) when it has no [argument]."""
  text = normalize_action(action)
  m = _ACTION.match(text)
  return (text, None) if m is None else (m.group(1), m.group(2))


class _WebShopIndex:
  """What `AdmissibleCommandEnv.step` asks of an index: `match` (the canonical command WebShop acts
  on, or None) and `commands` (the available actions)."""

  def __init__(self, page: Page):
    self.page = page
    self.commands = page.available_actions()
    # Actions arrive whitespace-collapsed: so are the keys they are looked up by.
    self._clickable = {normalize_action(k): k for k in page.clickables}

  def match(self, action: Any) -> Optional[str]:
    name, arg = parse_webshop_action(action)
    if name == "search" and arg is not None:  # any text, a blank one too (it finds nothing)
      return f"search[{arg}]"
    if name == "click" and arg in self._clickable and arg != "search":
      return f"click[{self._clickable[arg]}]"
    return None


class WebShopEnv(AdmissibleCommandEnv):
  """WebShop's text environment on one catalog; `reset(task)` starts the task's goal.

  Args:
    max_steps: the episode ends after this many steps (valid or not).
    data_dir: the data folder (default: `$WEBSHOP_DATA`, else the shipped fixture).
    human_goals: human-written goals instead of WebShop's synthetic ones (verl-agent: False).
    reward: "won" (1.0 for a perfect purchase, verl-agent) or "score" (WebShop's score).
    expert: accepted for the registry's sake; `expert_action()` always works.
    spacy_model: a spaCy pipeline for the type reward's nouns (WebShop: "en_core_web_sm"); None:
      `webshop_reward.HeuristicNouns`.
    price_seed: seeds product prices and goal price caps.
  """

  def __init__(self, max_steps: int = 15, data_dir: Optional[str] = None,
               human_goals: bool = False, reward: str = "won", expert: bool = False,
               spacy_model: Optional[str] = None, price_seed: int = 0):
    super().__init__()
    if reward not in REWARDS:
      raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    self.max_steps = max_steps
    self.reward_mode = reward
    self.expert = expert
    self.catalog = load_catalog(data_dir, human_goals, price_seed)
    self.nouns = (webshop_reward.SpacyNouns(spacy_model) if spacy_model
                  else webshop_reward.HeuristicNouns())
    self.task: Optional[Task] = None
    self.goal: Optional[dict] = None
    self.session = _Session()
    self.page: Optional[Page] = None
    self.last_score: Optional[float] = None
    self.last_reward_info: Optional[dict] = None

  def goal_index(self, task: Task) -> int:
    """The goal index of a task id of this env's goal kind; ValueError otherwise."""
    prefix = _task_prefix(self.catalog.human_goals)
    tail = task.task_id[len(prefix):] if task.task_id.startswith(prefix) else ""
    if not tail.isdigit() or int(tail) >= len(self.catalog.goals):
      raise ValueError(f"task {task.task_id!r} is not one of this catalog's "
                       f"{len(self.catalog.goals)} goals ({prefix}<index>)")
    return int(tail)

  def reset(self, task: Task, seed: int = 0) -> EnvStep:
    """Starts the task's goal on the search page. Deterministic; `seed` only seeds `search[<r>]`."""
    self.goal = self.catalog.goals[self.goal_index(task)]
    self.task = task
    self._rng = random.Random(seed)
    self.session = _Session()
    self._t, self._done, self._won = 0, False, False
    self.last_score = self.last_reward_info = None
    observation = self._show()
    return EnvStep(observation=observation, admissible_actions=self._admissible.commands)

  def _show(self) -> str:
    self.page = render(self.session, self.goal, self.catalog)
    self._state = self.page
    self._admissible = _WebShopIndex(self.page)
    return self.page.observation()

  def _unknown_command_observation(self) -> str:
    return self.page.observation()  # WebShop leaves the page as it is

  def _play(self, command: str) -> tuple[str, bool, bool]:
    name, arg = _ACTION.match(command).groups()  # the index's canonical command
    s = self.session
    if name == "search":
      self._search(arg.split(" "))
    else:
      kind, what = self.page.clickables[arg]
      if kind == "product":
        s.page, s.asin = "item", what
      elif kind == "option":
        s.options[what[0]] = what[1]
        s.page = "item"
      elif what == BUY:
        return self._buy()
      elif what == BACK_TO_SEARCH:
        self.session = _Session()
      elif what == NEXT and s.page == "results":
        s.page_num += 1
      elif what == PREV and s.page == "results":
        s.page_num -= 1
      elif what == PREV and s.page == "item":
        self._search(s.keywords, s.page_num)
      elif what in SUB_PAGES:
        s.page = what.lower()
      else:  # < Prev on a sub-page
        s.page = "item"
    return self._show(), False, False

  def _search(self, keywords: list, page_num: int = 1) -> None:
    s = self.session
    s.page, s.keywords, s.page_num, s.asin, s.options = "results", keywords, page_num, None, {}
    s.results = self._top_products(keywords)

  def _top_products(self, keywords: list) -> list:
    """WebShop's `get_top_n_product_from_keywords`, with its <r>/<a>/<c>/<q> shortcuts."""
    cat = self.catalog
    rest = " ".join(keywords[1:]).strip()
    if keywords[0] == "<r>":
      return [p["asin"] for p in self._rng.sample(cat.products, min(SEARCH_RETURN_N,
                                                                    len(cat.products)))]
    if keywords[0] == "<a>":
      return [p["asin"] for p in cat.products if rest in p["Attributes"]]
    if keywords[0] == "<c>":
      return [p["asin"] for p in cat.products if len(keywords) > 1
              and p["category"] == keywords[1].strip()]
    if keywords[0] == "<q>":
      return [p["asin"] for p in cat.products if p["query"] == rest]
    return cat.engine.search(" ".join(keywords))

  def _buy(self) -> tuple[str, bool, bool]:
    s = self.session
    score, info = webshop_reward.purchase_reward(
        self.catalog.by_asin[s.asin], self.goal, self.catalog.prices[s.asin], s.options,
        self.nouns)
    self.last_score, self.last_reward_info = score, info
    s.page, s.score = "done", score
    return self._show(), score == 1.0, True

  def step(self, action: str) -> EnvStep:
    """Plays one action; on the buying step the reward is the purchase's ("won" or "score" mode)
    and `score` its score either way."""
    out = super().step(action)
    bought = out.valid and self.session.page == "done"  # only buying reaches the done page
    if not bought:
      return out
    score = float(self.last_score)
    return dataclasses.replace(out, score=score,
                               reward=score if self.reward_mode == "score" else out.reward)

  def expert_action(self) -> Optional[str]:
    """A scripted shopper's next action from the current page (None once the episode is over):
    search the goal product's title, open the goal product (paging on up to 5 result pages, else
    the first result), choose the goal's options, buy."""
    if self.page is None or self._done:
      return None
    goal, s = self.goal, self.session
    target = goal["asin"]
    if s.page == "search":
      return f"search[{self.catalog.by_asin[target]['Title'].lower()}]"
    if s.page == "results":
      shown = [what for kind, what in self.page.clickables.values() if kind == "product"]
      if target in shown:
        return f"click[{target.lower()}]"
      more = s.page_num * PRODUCT_WINDOW < len(s.results)
      if more and s.page_num < 5:
        return "click[next >]"
      return f"click[{shown[0].lower()}]" if shown else "click[back to search]"
    if s.page in ("description", "features", "reviews"):
      return "click[< prev]"
    if s.asin != target and s.keywords:
      return "click[< prev]"
    for value in self._goal_option_clicks():
      if value not in s.options.values():
        return f"click[{value}]"
    return "click[buy now]"

  def _goal_option_clicks(self) -> list:
    """For each goal option, the item page's option that matches it as the reward matches
    options (an equal one first), when there is one."""
    opts = self.goal["goal_options"]
    shown = [what[1] for kind, what in self.page.clickables.values() if kind == "option"]
    out = []
    for g in (str(v).lower() for v in (opts.values() if isinstance(opts, dict) else opts)):
      norm = webshop_reward.normalize_color(g)
      close = [v for v in shown if v == g] + [
          v for v in shown if webshop_reward.token_set_ratio(
              webshop_reward.normalize_color(v), norm) > webshop_reward.FUZZ_THRESHOLD]
      if close:
        out.append(close[0])
    return out



# ---------------------------------------------------------------------------------------------
# CLI.


def main(argv: Optional[Sequence[str]] = None) -> float:
  """Plays the scripted expert on the first tasks of a split; prints and returns its success."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--expert", action="store_true", help="play the scripted expert (required)")
  ap.add_argument("--split", default="test", choices=SPLITS)
  ap.add_argument("--num-tasks", type=int, default=20)
  ap.add_argument("--data-dir", default=None)
  ap.add_argument("--human-goals", action="store_true")
  args = ap.parse_args(argv)
  if not args.expert:
    ap.error("only --expert play is implemented")
  if args.num_tasks < 1:
    ap.error(f"--num-tasks must be >= 1, got {args.num_tasks}")
  try:
    resolve_data_dir(args.data_dir)
  except FileNotFoundError as e:
    ap.error(f"--data-dir: {e}")
  env = WebShopEnv(data_dir=args.data_dir, human_goals=args.human_goals, reward="score")
  tasks = webshop_tasks(args.split, args.data_dir, args.human_goals, args.num_tasks)
  wins, scores, start = 0, [], time.perf_counter()
  for task in tasks:
    step = env.reset(task)
    while not step.done:
      step = env.step(env.expert_action())
    wins += step.won
    scores.append(env.last_score or 0.0)
  rate = wins / max(len(tasks), 1)
  print(f"WebShop expert on {len(tasks)} {args.split} tasks of {env.catalog.root}: "
        f"success {wins}/{len(tasks)} = {rate:.2f}, mean score "
        f"{sum(scores) / max(len(scores), 1):.3f} ({time.perf_counter() - start:.1f} s)")
  return rate


if __name__ == "__main__":
  main()
