"""WebShop (envs/webshop.py, envs/webshop_reward.py) on the shipped fixture catalog.

The reward cases are worked by hand from WebShop's `get_reward` (goal.py); the pages and actions
follow its text environment; the fuzzing is the one the ALFWorld and TextWorld envs get.
"""

import json
import random

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("thefuzz")

from hypothesis import HealthCheck, given, settings  # pylint: disable=wrong-import-position

from envs import registry  # pylint: disable=wrong-import-position
from envs import webshop as ws  # pylint: disable=wrong-import-position
from envs import webshop_reward as wr  # pylint: disable=wrong-import-position
from envs.base import EPISODE_OVER, Task  # pylint: disable=wrong-import-position
from envs.webshop_data import make_fixture  # pylint: disable=wrong-import-position
from tests.env_fuzz import check_junk_step, junk_actions  # pylint: disable=wrong-import-position

WORDS = lambda text: text.lower().split()  # a tagger whose nouns are all words: hand-countable


def _product(**kw):
  p = dict(name="Red Running Shoes", Title="Red Running Shoes", query="running shoes",
           product_category="A › B › C", BulletPoints=["light"], Description="",
           Attributes=["lightweight", "non slip"])
  p.update(kw)
  return p


def _goal(**kw):
  g = dict(name="Red Running Shoes", query="running shoes", product_category="A › B › C",
           attributes=["lightweight", "non slip"], goal_options=["red", "size 9"],
           price_upper=50.0)
  g.update(kw)
  return g


RIGHT = {"color": "red", "size": "size 9"}


# -- the reward, case by case ------------------------------------------------------------------


def test_perfect_purchase_scores_one():
  score, info = wr.purchase_reward(_product(), _goal(), 40.0, RIGHT, WORDS)
  assert score == 1.0 and info["r_type"] == 1.0 and info["r_price"]
  assert info["w_att"] == 2 / 5 and info["w_option"] == 2 / 5 and info["w_price"] == 1 / 5


def test_each_missed_term_costs_its_share():
  # (attributes 2 + options 1 + price 1) / (2 + 2 + 1): 'blue' matches neither 'red' nor 'size 9'.
  assert wr.purchase_reward(_product(), _goal(), 40.0, {"color": "blue", "size": "size 9"},
                            WORDS)[0] == pytest.approx(4 / 5)
  # Over the price cap: (2 + 2 + 0) / 5.
  score, info = wr.purchase_reward(_product(), _goal(), 60.0, RIGHT, WORDS)
  assert score == pytest.approx(4 / 5) and not info["r_price"]
  # No option chosen: (2 + 0 + 1) / 5.
  assert wr.purchase_reward(_product(), _goal(), 40.0, {}, WORDS)[0] == pytest.approx(3 / 5)


def test_attributes_match_fuzzily_or_in_the_text():
  # lightweight: an attribute; arch support: in a bullet point; waterproof: nowhere.
  product = _product(BulletPoints=["great arch support"], Attributes=["lightweight"])
  goal = _goal(attributes=["lightweight", "arch support", "waterproof"])
  score, info = wr.purchase_reward(product, goal, 40.0, RIGHT, WORDS)
  assert score == pytest.approx((2 + 2 + 1) / 6) and info["r_att"] == pytest.approx(2 / 3)
  assert wr.attribute_matches(_product(Description="Fully WATERPROOF."), ["waterproof"]) == 1
  # Fuzzy: difflib-style ratio 2 * 11 / (12 + 11) = 96 > 85; 'heavy' shares nothing.
  assert wr.token_set_ratio("light weight", "lightweight") == 96
  assert wr.attribute_matches(_product(Attributes=["light weight"]), ["lightweight"]) == 1
  assert wr.attribute_matches(_product(Attributes=["heavy"]), ["lightweight"]) == 0


@pytest.mark.parametrize("goal_name, category, r_type, title_score", [
    ("Red Running Shoes", "X › B › Y", 1.0, 1 / 3),  # 1 of 3 nouns: > 0.2 is a match
    ("red running shoes for tall men", "X › B › Y", 0.5, 1 / 6),  # no match of any kind
    ("red running shoes for tall men", "X › B › C", 1.0, 1 / 6),  # 2 shared category levels
    ("a b c d e f g h i j shoes", "X › B › C", 0.1, 1 / 11),  # under 10% of the nouns
    ("red running boots", "A › B › C", 0.0, 0.0),  # no noun in common: nothing, whatever else
])
def test_type_reward_thresholds(goal_name, category, r_type, title_score):
  product = _product(name="Blue Canvas Shoes", query="canvas shoes", product_category=category)
  info = wr.type_reward(product, _goal(name=goal_name), WORDS)
  assert info["r_type"] == r_type and info["title_score"] == pytest.approx(title_score)
  score, _ = wr.purchase_reward(product, _goal(name=goal_name), 40.0, RIGHT, WORDS)
  assert score == pytest.approx(r_type)


def test_goal_name_without_nouns_counts_a_fifth():
  no_nouns = lambda text: []  # pylint: disable=unnecessary-lambda-assignment
  assert wr.type_reward(_product(), _goal(), no_nouns)["r_type"] == 1.0  # the query matches
  other = _product(query="boots", product_category="X › Y")
  info = wr.type_reward(other, _goal(), no_nouns)
  assert info["title_score"] == 0.2 and info["r_type"] == 0.5


def test_colours_are_normalized_to_webshops_first_colour_word():
  assert wr.normalize_color("navy blue") == "blue"  # 'blue' precedes 'navy' in the list
  assert wr.normalize_color("heather grey") == "grey"
  assert wr.normalize_color("midnight navy") == "midnight"
  assert wr.normalize_color("size 9") == "size 9"
  assert wr.normalize_color(("color", "navy blue")) == ("color", "navy blue")  # a pair: equality
  assert wr.normalize_color(("color", "red")) == "red"
  # So a goal asking for 'navy' is missed by 'midnight navy', as in WebShop.
  assert wr.option_matches(["midnight navy"], ["navy"]) == 0
  assert wr.option_matches(["navy blue"], ["blue"]) == 1


def test_option_matching_is_token_set_fuzzy():
  assert wr.token_set_ratio("small", "x-small") == 100  # one token set inside the other
  assert wr.option_matches(["x-small"], ["small"]) == 1
  assert wr.option_matches(["large"], ["red"]) == 0
  # Synthetic goals: a dict's (name, value) pairs, compared through their text, as WebShop does.
  assert wr.goal_option_items({"color": "navy blue"}) == [("color", "navy blue")]
  assert wr.option_matches(["navy blue"], {"color": "navy blue", "size": "9"}) == 1
  assert wr.option_matches(["navy blue", "9"], {"color": "navy blue", "size": "9"}) == 2


def test_reward_refuses_goals_webshop_never_makes():
  with pytest.raises(ValueError, match="attributes"):
    wr.purchase_reward(_product(), _goal(attributes=[]), 1.0, {})
  with pytest.raises(ValueError, match="price_upper"):
    wr.purchase_reward(_product(), _goal(price_upper=0), 1.0, {})


def test_spacy_nouns_take_a_pipelines_noun_tags(tmp_path):
  spacy = pytest.importorskip("spacy")
  spacy.blank("en").to_disk(tmp_path / "blank")  # no tagger: no token is a NOUN
  nouns = wr.SpacyNouns(str(tmp_path / "blank"))
  assert nouns("Red Running Shoes") == [] and nouns.name.startswith("spacy:")
  with pytest.raises(OSError):
    wr.SpacyNouns("no_such_pipeline")
  with pytest.raises(OSError):
    ws.WebShopEnv(spacy_model="no_such_pipeline")


def test_tagger_comparison_counts_type_changes(catalog):
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "webshop_nouns", ws.FIXTURE_DIR.parents[2] / "experiments" / "webshop_nouns.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  small = ws.Catalog(catalog.root, catalog.products[:12], catalog.by_asin, catalog.prices,
                     catalog.goals[:10], False)
  same = mod.compare(small, wr.HeuristicNouns(), wr.HeuristicNouns())
  assert same == dict(pairs=120, type_differs=0, type_differs_share=0.0,
                      mean_abs_score_change=0.0, max_abs_score_change=0.0)
  none = mod.compare(small, wr.HeuristicNouns(), lambda text: [], lower=True)
  assert none["type_differs"] > 0 and 0 < none["mean_abs_score_change"] <= 1


def test_heuristic_nouns_drop_closed_class_words():
  assert wr.HeuristicNouns()("The Women's T-Shirt for Men, 2 Pack") == ["women's", "shirt", "men",
                                                                       "pack"]


# -- data --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def catalog():
  return ws.load_catalog()


def test_fixture_is_written_by_its_script(tmp_path):
  for path in make_fixture.write(tmp_path):
    assert path.read_bytes() == (ws.FIXTURE_DIR / path.name).read_bytes()
  assert sum((ws.FIXTURE_DIR / f).stat().st_size for f in ws.DATA_FILES) < 150_000


def test_loader_follows_webshops_schema(catalog):
  items = json.loads((ws.FIXTURE_DIR / ws.DATA_FILES[0]).read_text())
  assert len(items) == 63 and len(catalog.products) == 60  # 'nan', too long and repeated dropped
  p = catalog.products
  assert p[0]["Price"] == "$100.0" and catalog.prices[p[0]["asin"]] == 100.0
  assert p[1]["pricing"] == [12.5, 19.99] and 12.5 <= catalog.prices[p[1]["asin"]] <= 19.99
  assert p[1]["Price"] == "$12.5 to $19.99"
  assert p[2]["options"] == {"color": ["black | white"]}  # '/' shown as ' | ', None dropped
  assert p[3]["Description"] == "" and isinstance(p[4]["BulletPoints"], list)
  assert p[5]["Attributes"] == ["DUMMY_ATTR"] and "brand" not in p[6]
  assert all(q["query"] == q["query"].lower().strip() for q in p)
  assert ws.parse_pricing("$10.00 - $20.00") == ([10.0, 20.0], "$10.0 to $20.0")
  with pytest.raises(ValueError, match="pricing"):
    ws.parse_pricing("$abc")


def test_goals_are_webshops_in_its_shuffled_order(catalog):
  human = ws.load_catalog(human_goals=True)
  assert len(catalog.goals) >= 100 and len(human.goals) >= 100
  # The product without attributes has no synthetic goal; the human goal without any is skipped.
  assert not any(g["asin"] == catalog.products[5]["asin"] for g in catalog.goals)
  assert all(g["attributes"] for g in human.goals)
  rng = random.Random(0)  # price_seed 0: prices first, then the price caps
  assert ws.make_goals(catalog.products, ws.product_prices(catalog.products, rng), False,
                       rng) == catalog.goals
  # WebShop's own shuffle: random.seed(233); random.shuffle(goals) on the goals in catalog order.
  order = list(range(len(catalog.goals)))
  random.Random(233).shuffle(order)
  state = random.getstate()
  try:
    random.seed(233)
    legacy = list(range(len(catalog.goals)))
    random.shuffle(legacy)
  finally:
    random.setstate(state)
  assert order == legacy
  g = catalog.goals[0]
  assert g["price_upper"] > catalog.prices[g["asin"]]
  assert g["instruction_text"].endswith(f"price lower than {g['price_upper']:.2f} dollars")
  assert isinstance(g["goal_options"], dict) and isinstance(human.goals[0]["goal_options"], list)


def test_splits_are_disjoint_and_cover_the_goals(catalog):
  train, test = ws.webshop_tasks("train"), ws.webshop_tasks("test")
  assert len(test) == len(catalog.goals) // 5 and len(train) + len(test) == len(catalog.goals)
  assert not {t.task_id for t in train} & {t.task_id for t in test}
  assert test[0].task_id == "webshop-synth-0" and test[0].task_type == catalog.goals[0]["category"]
  assert len(ws.webshop_tasks("train", num_tasks=3)) == 3
  with pytest.raises(ValueError, match="split"):
    ws.webshop_tasks("valid")


def test_data_folder_is_checked(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="items_shuffle_1000.json"):
    ws.resolve_data_dir(str(tmp_path))
  for f in ws.DATA_FILES:
    (tmp_path / f).write_text((ws.FIXTURE_DIR / f).read_text())
  monkeypatch.setenv("WEBSHOP_DATA", str(tmp_path))
  assert ws.resolve_data_dir() == tmp_path
  assert ws.load_catalog().root == tmp_path.resolve()
  (tmp_path / ws.DATA_FILES[0]).write_text("[]")
  with pytest.raises(ValueError, match="no products"):
    ws.load_catalog()


def test_search_ranks_by_bm25_over_webshops_document(catalog):
  p = catalog.products[10]
  assert catalog.engine.search(p["Title"])[0] == p["asin"]
  assert ws.search_document(p).startswith(p["Title"].lower())
  assert catalog.engine.search("the and of") == [] and catalog.engine.search("") == []
  assert len(catalog.engine.search("made for everyday use")) == ws.SEARCH_RETURN_N


# -- the environment ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env():
  e = ws.WebShopEnv()
  yield e
  e.close()


def _goal_task(catalog, with_options=True):
  for i in ws.webshop_tasks("test"):
    goal = catalog.goals[int(i.task_id.rsplit("-", 1)[1])]
    if bool(goal["goal_options"]) == with_options:
      return i, goal
  raise AssertionError("no such goal")


def test_search_page_and_results_pages(env, catalog):
  task, goal = _goal_task(catalog)
  first = env.reset(task)
  instr = goal["instruction_text"]
  assert first.observation == f"WebShop [SEP] Instruction: [SEP] {instr} [SEP] Search"
  assert first.admissible_actions == ("search[<your query>]", "click[search]")
  step = env.step("search[made for everyday use]")
  texts = step.observation.split(" [SEP] ")
  assert texts[:5] == ["Instruction:", instr, "Back to Search", "Page 1 (Total results: 50)",
                       "Next >"]
  asins = texts[5::3]
  assert len(asins) == 10 and all(catalog.by_asin[a]["Title"] == t for a, t in
                                  zip(asins, texts[6::3]))
  assert step.admissible_actions == ("click[back to search]", "click[next >]",
                                     *(f"click[{a.lower()}]" for a in asins))
  page2 = env.step("click[next >]")
  assert "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >" in page2.observation
  assert "click[< prev]" in page2.admissible_actions
  assert env.step("click[< prev]").observation == step.observation
  assert env.step("click[back to search]").observation == first.observation


def test_item_page_options_sub_pages_and_buying(env, catalog):
  task, goal = _goal_task(catalog)
  env.reset(task)
  env.step(f"search[{catalog.by_asin[goal['asin']]['Title']}]")
  item = env.step(f"click[{goal['asin'].lower()}]")
  p = catalog.by_asin[goal["asin"]]
  texts = item.observation.split(" [SEP] ")
  assert texts[2:4] == ["Back to Search", "< Prev"]
  assert texts[-6:] == [f"Price: {p['Price']}", "Rating: N.A.", "Description", "Features",
                        "Reviews", "Buy Now"]
  for name, values in p["options"].items():
    assert " [SEP] ".join([name, *values]) in item.observation
  assert item.admissible_actions[:6] == ("click[back to search]", "click[< prev]",
                                         "click[description]", "click[features]",
                                         "click[reviews]", "click[buy now]")
  desc = env.step("click[description]")
  assert desc.observation.split(" [SEP] ")[2:] == ["Back to Search", "< Prev"] + (
      [p["Description"]] if p["Description"] else [])
  assert env.step("click[< prev]").observation == item.observation
  feats = env.step("click[features]").observation
  assert feats.endswith(" [SEP] ".join(b.strip() for b in p["BulletPoints"]))
  assert not env.step("click[reviews]").valid  # a sub-page offers only its two buttons
  env.step("click[< prev]")
  assert env.step("click[reviews]").observation.endswith("< Prev")  # no reviews in the data
  env.step("click[< prev]")
  for name, value in goal["goal_options"].items():
    assert env.step(f"click[{value}]").valid and env.session.options[name] == value
  bought = env.step("click[buy now]")
  assert bought.done and bought.won and bought.reward == 1.0 and env.last_score == 1.0
  assert bought.observation == ("Thank you for shopping with us! [SEP] Your score (min 0.0, max "
                                "1.0) [SEP] 1.0")
  over = env.step("click[buy now]")
  assert over.done and not over.valid and over.observation == EPISODE_OVER


def test_score_mode_and_an_imperfect_purchase(catalog):
  task, goal = _goal_task(catalog)
  env = ws.WebShopEnv(reward="score")
  env.reset(task)
  env.step(f"search[{catalog.by_asin[goal['asin']]['Title']}]")
  env.step(f"click[{goal['asin'].lower()}]")
  bought = env.step("click[buy now]")  # no option chosen
  n = len(goal["attributes"]) + len(goal["goal_options"]) + 1
  assert bought.done and not bought.won
  assert bought.reward == pytest.approx(env.last_score) == pytest.approx((n - len(
      goal["goal_options"])) / n)
  assert bought.score == bought.reward
  won_env = ws.WebShopEnv()
  assert won_env.reset(task).score is None
  assert won_env.step(f"search[{catalog.by_asin[goal['asin']]['Title']}]").score is None
  won_env.step(f"click[{goal['asin'].lower()}]")
  won_bought = won_env.step("click[buy now]")
  assert won_bought.reward == 0.0 and won_bought.score == bought.score  # graded either way
  with pytest.raises(ValueError, match="reward"):
    ws.WebShopEnv(reward="dense")


def test_unknown_tasks_products_and_actions(env, catalog):
  with pytest.raises(ValueError, match="goals"):
    env.reset(Task("webshop-synth-100000"))
  with pytest.raises(ValueError, match="goals"):
    env.reset(Task("webshop-human-0"))  # a human goal on a synthetic-goal env
  with pytest.raises(RuntimeError):
    ws.WebShopEnv().step("search[x]")
  first = env.reset(_goal_task(catalog)[0])
  for bad in ("click[b0zzzzzzzz]", "click[search]", "search[]", "search", "buy now", "click[]",
              "click[buy now]"):
    step = env.step(bad)
    assert not step.valid and step.observation == first.observation and not step.done
  empty = env.step("search[ ]")  # WebShop searches for a blank query too: nothing found
  assert empty.valid and "Page 1 (Total results: 0) [SEP] Next >" in empty.observation
  assert env.step("search[  RED   Shoes ]").valid  # case and spacing are forgiven
  assert env.step("search[shoes]").valid  # a search from the results page is played, as in WebShop


def test_special_searches(env, catalog):
  env.reset(ws.webshop_tasks("test")[0])
  q = catalog.products[0]["query"]
  step = env.step(f"search[<q> {q}]")
  assert f"(Total results: {sum(p['query'] == q for p in catalog.products)})" in step.observation
  step = env.step("search[<c> fashion]")
  assert f"(Total results: {sum(p['category'] == 'fashion' for p in catalog.products)})" in (
      step.observation)
  assert "(Total results: 50)" in env.step("search[<r>]").observation


def test_episode_ends_after_max_steps():
  e = ws.WebShopEnv(max_steps=3)
  e.reset(ws.webshop_tasks("test")[0])
  assert [e.step("click[nothing]").done for _ in range(3)] == [False, False, True]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=junk_actions("click", "click[", "click[]]", "search", "[x]", "\udcff\ud800",
                         "<action>click[buy now]</action>", "ünïcödé 日本語 🙂"))
def test_malformed_actions_are_invalid_steps(env, junk):
  def real(j, adm):  # a search, or a listed click
    name, arg = ws.parse_webshop_action(j)
    return name == "search" or f"click[{arg}]" in adm
  check_junk_step(env, ws.webshop_tasks("test")[1], junk, real, lambda: env.page.observation())


def test_expert_buys_the_goal_product(capsys):
  assert ws.main(["--expert", "--num-tasks", "20"]) == 1.0
  assert "success 20/20 = 1.00" in capsys.readouterr().out
  assert ws.main(["--expert", "--num-tasks", "20", "--human-goals", "--split", "train"]) == 1.0
  with pytest.raises(SystemExit):
    ws.main(["--num-tasks", "2"])


def test_expert_recovers_from_detours(catalog):
  e = ws.WebShopEnv()
  task, _ = _goal_task(catalog)
  e.reset(task)
  for detour in ("search[tea]", "click[next >]", f"click[{e.catalog.products[0]['asin'].lower()}]",
                 "click[features]"):
    e.step(detour)
  step = None
  for _ in range(e.max_steps):
    step = e.step(e.expert_action())
    if step.done:
      break
  assert step.won and e.expert_action() is None


def test_registry_builds_webshop():
  e = registry.make_env("webshop", max_steps=7, human_goals=True)
  assert isinstance(e, ws.WebShopEnv) and e.max_steps == 7
  tasks = registry.task_list("webshop", "test", human_goals=True, max_steps=7, expert=True)
  assert tasks[0].task_id == "webshop-human-0" and e.reset(tasks[0]).observation
  assert registry.task_list("webshop", "train", max_steps=5, num_tasks=2)[1].split == "train"


# -- the agent side: prompts, parsing, a training iteration ------------------------------------


def test_webshop_prompt_shows_the_task_once_and_quoted_pages(env):
  from salt_jax.agent import prompts  # pylint: disable=import-outside-toplevel
  first = env.reset(ws.webshop_tasks("test")[0])
  task, page = ws.observation_view(first.observation, first.observation)
  assert task == env.goal["instruction_text"] and page == "'Search'"
  results = env.step("search[made for everyday use]").observation
  _, page = ws.observation_view(first.observation, results)
  assert page.startswith("'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >'")
  assert ws.observation_view("no header", "done page") == ("no header", "done page")
  cfg = prompts.env_prompt_config("webshop", history_window=2)
  assert cfg.instruction == ws.INSTRUCTION and cfg.observation_view == "webshop"
  assert prompts.env_prompt_config("alfworld") == prompts.PromptConfig()
  with pytest.raises(ValueError, match="observation_view"):
    prompts.PromptConfig(observation_view="html")
  tok = prompts.toy_chat_tokenizer()
  for window in (None, 2):
    conv = prompts.Prompter(tok, prompts.env_prompt_config("webshop", history_window=window)
                            ).start(first.observation, first.admissible_actions)
    conv.advance([1], "search[made for everyday use]", results, ("click[next >]",))
    text = tok.decode(conv.prompt_ids)
    assert text.count(task) == 1 and "Your task: " + task in text
    assert "'click[next >]'" in text and "'Page 1 (Total results: 50)'" in text


def test_fuzzed_model_outputs_through_the_parser_and_env(env):
  from salt_jax.agent.parsing import parse_action  # pylint: disable=import-outside-toplevel
  from tests.test_parsing import fuzz_outputs  # pylint: disable=import-outside-toplevel
  env.max_steps = 10**9
  try:
    out = env.reset(ws.webshop_tasks("test")[2])
    for i, text in enumerate(fuzz_outputs(600, seed=2)):
      if i % 10 == 9:  # some real moves, so the page changes
        text = f"<action>{out.admissible_actions[i % len(out.admissible_actions)]}</action>"
      p = parse_action(text, out.admissible_actions)
      out = env.step(p.action if i % 2 else text)  # the raw text too: any str is a legal action
      assert isinstance(out.observation, str) and out.admissible_actions is not None
      if out.done:
        out = env.reset(ws.webshop_tasks("test")[2])
  finally:
    env.max_steps = 15


def test_webshop_recipe_is_verl_agents_with_webshops_episode_and_prompt_lengths():
  from salt_jax.recipes import RECIPES  # pylint: disable=import-outside-toplevel
  ws_recipe, alf = RECIPES["verl-agent-webshop"], RECIPES["verl-agent"]
  assert ws_recipe["max_steps"] == 15 and ws_recipe["max_cache_len"] == 4608
  assert {k: v for k, v in ws_recipe.items() if k not in ("max_steps", "max_cache_len")} == {
      k: v for k, v in alf.items() if k not in ("max_steps", "max_cache_len")}


def test_a_training_iteration_runs_on_webshop(tmp_path):
  from salt_jax.train import TrainConfig, Trainer  # pylint: disable=import-outside-toplevel
  cfg = TrainConfig(env="webshop", tokenizer="toy", group_size=2, tasks_per_iter=1,
                    num_train_tasks=2, max_steps=2, max_new_tokens=16, max_cache_len=1024,
                    env_workers=0, iters=1, minibatch_rows=4, progress=False, tensorboard=False,
                    out=str(tmp_path / "run"))
  with Trainer(cfg) as tr:
    tr.setup()
    row = tr.iteration()
  batch = tr.last.rollout
  assert row["iteration"] == 0 and batch.num_groups == 1 and len(batch.task_ids) == 2
  assert all(t.startswith("webshop-synth-") for t in batch.task_ids)
  assert all("Your task: " in tr.tokenizer.decode(p) for p in batch.prompt_ids)


def test_rollout_scores_are_the_purchases(catalog):
  """A rollout through the env pool keeps each trajectory's purchase score: an expert that
  chooses every option (score 1.0), one that buys without choosing (a partial score), and one
  that never buys (0.0), as replayed in a fresh env; the batch's `score` is their mean."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from envs.pool import EnvPool
  from salt_jax.agent.prompts import env_prompt_config, toy_chat_tokenizer
  from salt_jax.rollout import TextPolicySampler, collect
  task, goal = _goal_task(catalog)
  plans, env = {}, ws.WebShopEnv()
  step = env.reset(task)
  while not step.done:
    plans.setdefault("expert", []).append(env.expert_action())
    step = env.step(plans["expert"][-1])
  plans["no options"] = [plans["expert"][0], plans["expert"][1], "click[buy now]"]
  plans["browser"] = [plans["expert"][0]] * 3

  def policy_of(plan):
    def policy(text, rng):  # pylint: disable=unused-argument
      k = min(text.count("</action><|im_end|>"), len(plan) - 1)  # the responses so far
      return f"<think>step {k}</think>\n<action>{plan[k]}</action>"
    return policy

  tok = toy_chat_tokenizer()
  scores = {}
  for name, plan in plans.items():
    sampler = TextPolicySampler(tok, policy_of(plan), lambda context, token: 0.0)
    with EnvPool("webshop", {"max_steps": len(plan)}, 0) as pool:
      b = collect(pool, [task], 2, sampler, tok, jax.random.key(0),
                  prompt_config=env_prompt_config("webshop"), max_steps=len(plan))
    replay = ws.WebShopEnv()
    replay.reset(task)
    for action in plan:
      replay.step(action)
    want = replay.last_score or 0.0
    np.testing.assert_allclose(b.scores, [want, want], rtol=1e-6)
    assert b.metrics["score"] == pytest.approx(want)
    scores[name] = want
  assert scores["expert"] == 1.0 and 0.0 < scores["no options"] < 1.0 and scores["browser"] == 0.0
