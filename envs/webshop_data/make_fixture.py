"""Writes the WebShop fixture catalog: 60 made-up products in WebShop's own data schema.

  python envs/webshop_data/make_fixture.py [--out envs/webshop_data/fixture]

Files (the names and schema of WebShop's 1,000-product set, so `envs.webshop` reads both alike):
  items_shuffle_1000.json  a list of products: asin, name, query, category, product_category,
                           pricing ("$12.99" or "$10.00 - $20.00" or ""), full_description,
                           small_description (a list of bullet points, or one string),
                           customization_options ({name: [{value, image}]}), images, plus
                           fields WebShop's loader drops (brand, product_information).
  items_ins_v2_1000.json   asin -> {attributes, instruction, instruction_attributes}
  items_human_ins.json     asin -> [{asin, instruction, instruction_attributes,
                           instruction_options}]
5 categories x 4 product types x 3 products; they make 216 synthetic goals (one per option
combination) and 120 human ones. A few rows exercise the loader's edge cases: an asin 'nan', one
longer than 10 characters, a repeated asin, empty pricing, a price range, a '/' in an option value,
a description-less product, bullet points given as one string, a product without attributes.
Deterministic: the same files every run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

OUT = pathlib.Path(__file__).parent / "fixture"
BRANDS = ("Lumora", "Vantix", "Orrin", "Pelham", "Quillby", "Sorrel", "Tavi", "Wrenfield", "Yarrow")
SIZES = ("small", "medium", "large", "x-large")
COLORS = ("black", "navy blue", "heather grey", "olive green", "burgundy red", "white")

# category -> [(query, product_category, title noun, attribute pool, option names)]
TYPES = {
    "beauty": [
        ("shampoo", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
         "Shampoo", ["sulfate free", "paraben free", "dry hair", "natural ingredients",
                     "color safe"], ["size"]),
        ("face moisturizer", "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
         "Face Moisturizer", ["fragrance free", "sensitive skin", "hyaluronic acid",
                              "non greasy", "spf 30"], ["scent"]),
        ("lipstick", "Beauty & Personal Care › Makeup › Lips › Lipstick", "Matte Lipstick",
         ["long lasting", "cruelty free", "vegan", "high pigment"], ["color"]),
        ("hair extensions", "Beauty & Personal Care › Hair Care › Hair Extensions, Wigs & "
         "Accessories › Extensions", "Clip In Hair Extensions",
         ["natural looking", "human hair", "heat resistant", "easy to use"], ["color"]),
    ],
    "electronics": [
        ("wireless earbuds", "Electronics › Headphones, Earbuds & Accessories › Earbud Headphones",
         "Wireless Earbuds", ["noise cancelling", "long battery life", "water resistant",
                              "fast charging"], ["color"]),
        ("phone case", "Electronics › Cell Phones & Accessories › Cases, Holsters & Sleeves",
         "Phone Case", ["shockproof", "slim fit", "wireless charging compatible",
                        "scratch resistant"], ["color"]),
        ("hdmi cable", "Electronics › Computers & Accessories › Cables › HDMI Cables",
         "HDMI Cable", ["high speed", "gold plated", "4k", "braided"], ["size"]),
        ("bluetooth speaker", "Electronics › Portable Audio & Video › Portable Speakers",
         "Bluetooth Speaker", ["waterproof", "deep bass", "portable", "long battery life"],
         ["color"]),
    ],
    "fashion": [
        ("running shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
         "Running Shoes", ["lightweight", "breathable", "non slip", "arch support"],
         ["color", "size"]),
        ("t-shirt",
         "Clothing, Shoes & Jewelry › Women › Clothing › Tops, Tees & Blouses › T-Shirts",
         "Cotton T-Shirt", ["short sleeve", "machine wash", "soft cotton", "relaxed fit"],
         ["color", "size"]),
        ("winter jacket", "Clothing, Shoes & Jewelry › Men › Clothing › Jackets & Coats",
         "Winter Jacket", ["water resistant", "hooded", "warm lining", "zip pockets"],
         ["color", "size"]),
        ("yoga pants", "Clothing, Shoes & Jewelry › Women › Clothing › Active › Leggings",
         "Yoga Pants", ["high waist", "tummy control", "four way stretch", "moisture wicking"],
         ["color", "size"]),
    ],
    "grocery": [
        ("green tea", "Grocery & Gourmet Food › Beverages › Tea › Green Tea", "Green Tea Bags",
         ["organic", "caffeine", "non gmo", "individually wrapped"], ["flavor", "size"]),
        ("protein bar", "Grocery & Gourmet Food › Snacks › Bars › Protein Bars", "Protein Bars",
         ["gluten free", "low sugar", "high protein", "keto friendly"], ["flavor"]),
        ("coffee beans", "Grocery & Gourmet Food › Beverages › Coffee › Whole Bean",
         "Whole Bean Coffee", ["medium roast", "fair trade", "single origin", "arabica"],
         ["size"]),
        ("dark chocolate", "Grocery & Gourmet Food › Snacks › Chocolate › Bars",
         "Dark Chocolate Bar", ["dairy free", "70 percent cacao", "sugar free", "organic"],
         ["flavor"]),
    ],
    "furniture": [
        ("office chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
         "Ergonomic Office Chair", ["lumbar support", "adjustable height", "mesh back",
                                    "easy assembly"], ["color"]),
        ("bookshelf", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
         "Bookshelf", ["solid wood", "easy assembly", "storage space", "industrial style"],
         ["color", "size"]),
        ("bed sheets", "Home & Kitchen › Bedding › Sheets & Pillowcases › Sheet Sets",
         "Bed Sheet Set", ["deep pocket", "microfiber", "wrinkle free", "machine washable"],
         ["color", "size"]),
        ("throw pillow", "Home & Kitchen › Home Décor › Decorative Pillows › Throw Pillow Covers",
         "Throw Pillow Cover", ["velvet", "hidden zipper", "square", "decorative"], ["color"]),
    ],
}
OPTION_VALUES = {
    "color": COLORS,
    "size": SIZES,
    "scent": ("unscented", "lavender", "citrus"),
    "flavor": ("original", "mint", "vanilla", "sea salt caramel"),
}
ADJECTIVES = ("Premium", "Everyday", "Classic", "Ultra", "Essential", "Pro")


def _options(rng: random.Random, names: list, asin: str) -> dict:
  out = {}
  for name in names:
    k = 3 if name == "color" else 2
    values = rng.sample(OPTION_VALUES[name], k)
    out[name.capitalize()] = [
        {"value": v.title(), "image": f"https://example.invalid/{asin}/{i}.jpg"}
        for i, v in enumerate(values)]
  return out


def build(rng: random.Random) -> tuple[list, dict, dict]:
  """The three files' contents: (items, attributes by asin, human instructions by asin)."""
  items, attributes, human = [], {}, {}
  n = 0
  for category, types in TYPES.items():
    for query, path, noun, pool, option_names in types:
      for _ in range(3):
        n += 1
        asin = f"B0FX{n:06d}"
        attrs = rng.sample(pool, 3)
        brand, adj = rng.choice(BRANDS), rng.choice(ADJECTIVES)
        title = f"{brand} {adj} {noun} - {attrs[0].title()}, {attrs[1].title()}"
        price = round(rng.uniform(5, 150), 2)
        desc = (f"The {brand} {noun.lower()} is {attrs[0]} and {attrs[1]}. Made for everyday "
                f"use, it is also {attrs[2]}.")
        bullets = [f"{a.capitalize()}: a {noun.lower()} you can rely on." for a in attrs]
        item = {
            "asin": asin, "name": title, "query": query.title() + " ", "category": category,
            "product_category": path, "pricing": f"${price:.2f}", "full_description": desc,
            "small_description": bullets,
            "customization_options": _options(rng, option_names, asin),
            "images": [f"https://example.invalid/{asin}/main.jpg"], "brand": brand,
            "product_information": {"Item Weight": "1 pound"},
        }
        items.append(item)
        wanted = attrs[:rng.choice((1, 2))]
        attributes[asin] = {"attributes": attrs, "instruction_attributes": wanted,
                            "instruction": f"i'm looking for a {' and '.join(wanted)} {query}"}
        chosen = [rng.choice(opts)["value"].lower()
                  for opts in item["customization_options"].values()]
        human[asin] = [
            {"asin": asin, "instruction": f"I want {' '.join(wanted)} {query}"
             + (f" in {' and '.join(chosen)}" if chosen else "") + ".",
             "instruction_attributes": wanted, "instruction_options": chosen},
            {"asin": asin, "instruction": f"find me a {query} that is {attrs[2]}",
             "instruction_attributes": [attrs[2]], "instruction_options": chosen[:1]},
        ]
  # Edge cases of WebShop's loader.
  items[0]["pricing"] = ""  # no price: $100.0
  items[1]["pricing"] = "$12.50 - $19.99"  # a range: a uniform draw between the two
  items[2]["customization_options"] = {"Color": [{"value": "Black/White", "image": None}],
                                       "Size": None}  # '/' shown as ' | '; a None option dropped
  for ins in human[items[2]["asin"]]:
    ins["instruction_options"] = ["black/white"]
  items[3]["full_description"] = ""
  items[4]["small_description"] = items[4]["small_description"][0]  # one string
  del attributes[items[5]["asin"]]  # no attributes: ['DUMMY_ATTR'], no synthetic goal
  human[items[6]["asin"]].append({"asin": items[6]["asin"], "instruction": "anything nice",
                                  "instruction_attributes": [], "instruction_options": []})
  items.append(dict(items[7], name="a repeated asin is skipped"))
  items.append(dict(items[8], asin="nan"))
  items.append(dict(items[9], asin="B0FX00000099"))  # longer than 10 characters
  return items, attributes, human


def write(out: pathlib.Path = OUT) -> list[pathlib.Path]:
  """Writes the three files into `out`; returns their paths."""
  items, attributes, human = build(random.Random(0))
  out.mkdir(parents=True, exist_ok=True)
  paths = []
  for name, data in (("items_shuffle_1000.json", items), ("items_ins_v2_1000.json", attributes),
                     ("items_human_ins.json", human)):
    path = out / name
    path.write_text(json.dumps(data, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    paths.append(path)
  return paths


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--out", type=pathlib.Path, default=OUT)
  for p in write(ap.parse_args().out):
    print(p, p.stat().st_size, "bytes")
