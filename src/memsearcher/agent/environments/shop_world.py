"""A seeded offline shop: products, and shopping instructions written from target products.

WebShop (Yao et al., 2022) scrapes 1.18M Amazon products and writes instructions from a
product's attributes and options, by crowd workers (human goals) or from templates (synthetic
goals): "i need a long clip-in hair extension which is natural looking, with color: b, and
size: 16 inch, and price lower than 40.00 dollars". This module generates a small shop of the
same shape from a seed, as ``data/synthetic.py`` generates the QA demo's world, so nothing has to
be downloaded and every product is known exactly.

A product has a category (its type, such as "t-shirt"), a breadcrumb of departments, one value
for each of the category's attribute slots (material, style, feature), a few values for each of
its option names (size, color), and a price. Its title names its brand, attributes and type.

Products come in families. Each family has one target product, from which instructions are
written, and distractors that make search and reading matter:

- a near-duplicate for each attribute slot: the same brand and options, one attribute changed;
- an over-priced copy: the same product at a price above the instruction's limit.

An instruction asks for the target's attributes, one value of each of its option names, and a
price limit drawn as WebShop draws it (``goal.py``: the larger of two of the first four
multiples of 10 above the price). Splits are drawn by target product, so no ``rl`` or ``test``
instruction asks for a product that a ``train`` instruction asks for.
"""

from __future__ import annotations

import itertools
import random
import string
from dataclasses import dataclass, replace

from memsearcher.errors import MemSearcherError

__all__ = [
    "CATEGORIES",
    "SPLITS",
    "Catalogue",
    "Category",
    "Goal",
    "Instruction",
    "Product",
    "ShopConfig",
    "deal_ids",
    "generate_catalogue",
]

SPLITS = ("train", "rl", "test")
"""Instruction splits: SFT instructions, RL instructions, held-out test."""

_COLORS = ("navy", "black", "white", "heather grey", "olive", "burgundy", "sand", "teal")


@dataclass(frozen=True)
class Category:
    """A product type: what its products are called and how they may vary."""

    kind: str
    """The type noun phrase, as titles and instructions write it ("running shoes")."""
    article: str
    """What comes before an instruction's description ("a", "a pair of")."""
    breadcrumb: tuple[str, ...]
    """Departments from the top, as WebShop's ``product_category`` (split on "›")."""
    attributes: dict[str, tuple[str, ...]]
    """Attribute slots in title order; each product takes one value of each. The last slot is
    written after a comma ("..., machine washable")."""
    options: dict[str, tuple[str, ...]]
    """Option names and the values a product may offer."""
    prices: tuple[float, float]
    """Range of a target product's price, in dollars."""


CATEGORIES: dict[str, Category] = {
    "t-shirt": Category(
        "t-shirt", "a", ("clothing", "men", "shirts", "t-shirts"),
        {
            "style": ("crew neck", "v-neck", "slim fit", "relaxed fit", "pocket"),
            "material": ("cotton", "polyester", "linen", "bamboo", "merino wool"),
            "feature": ("moisture wicking", "machine washable", "quick dry", "wrinkle free"),
        },
        {"size": ("xs", "s", "m", "l", "xl", "xxl"), "color": _COLORS},
        (8.0, 35.0),
    ),
    "hoodie": Category(
        "hoodie", "a", ("clothing", "men", "sweatshirts", "hoodies"),
        {
            "style": ("pullover", "full zip", "oversized", "cropped"),
            "material": ("fleece", "cotton", "french terry", "sherpa"),
            "feature": ("kangaroo pocket", "thumb holes", "drawstring hood", "water repellent"),
        },
        {"size": ("s", "m", "l", "xl", "xxl"), "color": _COLORS},
        (20.0, 60.0),
    ),
    "running shoes": Category(
        "running shoes", "a pair of", ("clothing", "shoes", "men", "athletic"),
        {
            "style": ("lace-up", "slip-on", "wide toe box", "low top"),
            "material": ("mesh", "knit", "leather", "suede"),
            "feature": ("non-slip", "lightweight", "cushioned", "waterproof"),
        },
        {"size": ("7", "8", "9", "10", "11", "12"), "color": _COLORS},
        (30.0, 90.0),
    ),
    "backpack": Category(
        "backpack", "a", ("bags", "backpacks", "laptop backpacks"),
        {
            "style": ("rolltop", "zippered", "drawstring", "hiking"),
            "material": ("nylon", "canvas", "polyester", "vegan leather"),
            "feature": ("water resistant", "laptop sleeve", "anti-theft", "padded straps"),
        },
        {"capacity": ("20 liter", "25 liter", "30 liter", "40 liter"), "color": _COLORS},
        (15.0, 70.0),
    ),
    "coffee mug": Category(
        "coffee mug", "a", ("home & kitchen", "kitchen & dining", "drinkware", "mugs"),
        {
            "style": ("travel", "classic", "handleless", "double wall"),
            "material": ("ceramic", "stainless steel", "glass", "stoneware"),
            "feature": ("dishwasher safe", "microwave safe", "insulated", "leak proof"),
        },
        {"size": ("8 oz", "12 oz", "16 oz", "20 oz"), "color": _COLORS},
        (6.0, 30.0),
    ),
    "desk lamp": Category(
        "desk lamp", "a", ("home & kitchen", "lighting", "lamps", "desk lamps"),
        {
            "style": ("swing arm", "clip-on", "minimalist", "architect"),
            "material": ("aluminum", "wooden", "metal", "ceramic"),
            "feature": ("dimmable", "usb charging port", "touch control", "eye caring"),
        },
        {"light color": ("warm white", "daylight", "cool white"), "color": _COLORS},
        (12.0, 55.0),
    ),
}  # fmt: skip
"""The shop's product types. Their breadcrumbs share departments ("clothing", "men") the way
Amazon's do, so WebShop's category match can hold between different types."""


@dataclass(frozen=True)
class ShopConfig:
    """Sizes of the generated shop."""

    seed: int = 0
    """Seeds every choice; the same seed gives the same shop."""
    families_per_category: int = 8
    """Target products per category, each with its distractors."""
    instructions_per_product: int = 2
    """Instructions written per target product, each with its own option choice."""
    options_offered: int = 3
    """Values a product offers per option name."""
    rl_fraction: float = 0.3
    """Share of target products whose instructions form the ``rl`` split."""
    test_fraction: float = 0.25
    """Share of target products whose instructions form the held-out ``test`` split."""

    def __post_init__(self) -> None:
        fewest = min(len(v) for c in CATEGORIES.values() for v in c.options.values())
        if not 1 <= self.options_offered <= fewest:
            raise MemSearcherError(
                f"shop.options_offered must be in 1..{fewest} (the fewest values of an option), "
                f"got {self.options_offered}"
            )
        if self.families_per_category < 1 or self.instructions_per_product < 1:
            raise MemSearcherError(
                "shop.families_per_category and shop.instructions_per_product must be at least 1"
            )
        if (
            min(self.rl_fraction, self.test_fraction) < 0
            or self.rl_fraction + self.test_fraction > 1
        ):
            raise MemSearcherError(
                "shop.rl_fraction and shop.test_fraction must be shares that sum to at most 1, "
                f"got {self.rl_fraction} and {self.test_fraction}"
            )


@dataclass(frozen=True)
class Product:
    """One product of the shop, as its item page shows it."""

    asin: str
    category: str
    """A key of ``CATEGORIES``."""
    brand: str
    title: str
    attributes: dict[str, str]
    """Attribute slot -> value."""
    options: dict[str, tuple[str, ...]]
    """Option name -> the values offered, in page order."""
    price: float

    @property
    def kind(self) -> str:
        return CATEGORIES[self.category].kind

    @property
    def breadcrumb(self) -> tuple[str, ...]:
        return CATEGORIES[self.category].breadcrumb


@dataclass(frozen=True)
class Goal:
    """What an instruction asks for: WebShop's goal dict, with structured fields."""

    asin: str
    """The target product the instruction was written from."""
    category: str
    attributes: tuple[str, ...]
    """Attribute values the product must have."""
    options: dict[str, str]
    """Option name -> the value to choose."""
    price_upper: float
    """The price must be at most this."""


@dataclass(frozen=True)
class Instruction:
    """One shopping task."""

    id: str
    text: str
    goal: Goal
    split: str


@dataclass(frozen=True)
class Catalogue:
    """The products and instructions of one generated shop."""

    config: ShopConfig
    products: tuple[Product, ...]
    instructions: tuple[Instruction, ...]

    def product(self, asin: str) -> Product:
        for product in self.products:
            if product.asin == asin:
                return product
        raise KeyError(asin)

    def split(self, name: str) -> list[Instruction]:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; known: {list(SPLITS)}")
        return [i for i in self.instructions if i.split == name]


def generate_catalogue(config: ShopConfig = ShopConfig()) -> Catalogue:
    """The shop for ``config``: the same config gives the same products and instructions."""
    rng = random.Random(config.seed)
    asins: set[str] = set()
    products: list[Product] = []
    instructions: list[Instruction] = []
    targets: list[tuple[Product, float]] = []
    for name, category in CATEGORIES.items():
        for _ in range(config.families_per_category):
            family, price_upper = _family(rng, config, name, category, asins)
            products.extend(family)
            targets.append((family[0], price_upper))
    splits = _splits(rng, config, len(targets))
    for (target, price_upper), split in zip(targets, splits, strict=True):
        # distinct option choices, as WebShop writes one synthetic goal per combination
        combinations = list(itertools.product(*target.options.values()))
        for combination in rng.sample(
            combinations, min(config.instructions_per_product, len(combinations))
        ):
            chosen = dict(zip(target.options, combination, strict=True))
            goal = Goal(
                target.asin, target.category, tuple(target.attributes.values()), chosen,
                price_upper,
            )  # fmt: skip
            instructions.append(
                Instruction(f"{split}-{len(instructions)}", _instruction_text(goal), goal, split)
            )
    rng.shuffle(products)
    return Catalogue(config, tuple(products), tuple(instructions))


def deal_ids(catalogue: Catalogue, ids: list[str], seed: int) -> Catalogue:
    """``catalogue`` with its product ids replaced by ``ids`` (as many), dealt at random: its
    products and instructions under another shop's ids, for a model whose vocabulary holds
    that shop's ids (the shop demo's SFT shops, and its RL on a fresh shop)."""
    if len(ids) != len(catalogue.products):
        raise ValueError(f"{len(ids)} ids for {len(catalogue.products)} products")
    dealt = random.Random(seed).sample(ids, len(ids))
    new = {p.asin: asin for p, asin in zip(catalogue.products, dealt, strict=True)}
    products = tuple(replace(p, asin=new[p.asin]) for p in catalogue.products)
    instructions = tuple(
        replace(i, goal=replace(i.goal, asin=new[i.goal.asin])) for i in catalogue.instructions
    )
    return replace(catalogue, products=products, instructions=instructions)


def _family(
    rng: random.Random, config: ShopConfig, name: str, category: Category, asins: set[str]
) -> tuple[list[Product], float]:
    """A target product, its near-duplicates and its over-priced copy; and the price limit."""
    brand = _brand(rng)
    attributes = {slot: rng.choice(values) for slot, values in category.attributes.items()}
    options = {
        option: tuple(sorted(rng.sample(values, config.options_offered), key=values.index))
        for option, values in category.options.items()
    }
    price = _price(rng.uniform(*category.prices))
    # goal.py: the larger of two draws from the first four multiples of 10 above the price
    price_upper = sorted(rng.sample([10.0 * i for i in range(1, 100) if 10 * i > price][:4], 2))[1]

    def make(attrs: dict[str, str], cost: float) -> Product:
        title = _title(brand, category, attrs)
        return Product(_asin(rng, asins), name, brand, title, attrs, options, cost)

    family = [make(attributes, price)]
    for slot, values in category.attributes.items():
        other = rng.choice([v for v in values if v != attributes[slot]])
        cost = min(_price(price + rng.uniform(-3, 3)), price_upper - 1)
        family.append(make({**attributes, slot: other}, max(cost, 1.99)))
    family.append(make(attributes, _price(price_upper + rng.uniform(1, 15))))
    return family, price_upper


def _splits(rng: random.Random, config: ShopConfig, count: int) -> list[str]:
    """A split for each of ``count`` target products, in the configured shares."""
    n_test = round(count * config.test_fraction)
    n_rl = round(count * config.rl_fraction)
    splits = ["test"] * n_test + ["rl"] * n_rl + ["train"] * (count - n_test - n_rl)
    rng.shuffle(splits)
    return splits


def _instruction_text(goal: Goal) -> str:
    """WebShop's synthetic template: a description, then ``with name: value, and ...``."""
    category = CATEGORIES[goal.category]
    *before, last = goal.attributes
    described = " ".join([*before, category.kind])
    article = _a(described) if category.article == "a" else f"{category.article} {described}"
    options = ", and ".join(f"{option}: {value}" for option, value in goal.options.items())
    return (
        f"i need {article}, {last}, with {options}, "
        f"and price lower than {goal.price_upper:.2f} dollars"
    )


def _title(brand: str, category: Category, attributes: dict[str, str]) -> str:
    *before, last = attributes.values()
    words = " ".join([*before, category.kind])
    return f"{brand} {string.capwords(words)}, {last.capitalize()}"


def _a(phrase: str) -> str:
    return f"an {phrase}" if phrase[0] in "aeiou" else f"a {phrase}"


def _brand(rng: random.Random) -> str:
    syllables = ["ka", "lo", "ve", "ri", "mo", "zen", "tor", "sa", "bel", "qu", "ix", "na"]
    return "".join(rng.sample(syllables, 2)).capitalize() + rng.choice(["", "co", "ly", "x"])


def _asin(rng: random.Random, taken: set[str]) -> str:
    """A fresh Amazon-style id: B0 and eight capitals or digits, as WebShop's are."""
    while True:
        asin = "B0" + "".join(rng.choices(string.ascii_uppercase + string.digits, k=8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _price(dollars: float) -> float:
    return round(max(int(dollars), 1) + 0.99, 2)
