"""The embedded fact corpus: a seeded generator of invented entities, facts and passages.

Invented entities with pronounceable names, 10 relations, several phrasings per fact as
separate passages, distractor passages that state no fact, exact gold `evidence_ids`, and
>= 3 prompt templates per relation that end right before the object (paper §A.4 / Table A.1
style). Used by the quickstart, the tests and CI: no download, seconds to build.
"""

from __future__ import annotations

import numpy as np

from trackstar_jax.data import corpus_types as corpus_lib

# ---------------------------------------------------------------------------------------
# The embedded fact corpus
# ---------------------------------------------------------------------------------------

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "tr", "st", "sh", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou")
_CODAS = ("", "", "", "", "", "", "n", "r", "l", "s", "m")
_INSTRUMENTS = (
    "piano",
    "violin",
    "cello",
    "flute",
    "trumpet",
    "harp",
    "guitar",
    "clarinet",
    "drums",
    "oboe",
    "saxophone",
    "accordion",
)
_OCCUPATIONS = (
    "painter",
    "chemist",
    "sailor",
    "teacher",
    "architect",
    "baker",
    "surgeon",
    "poet",
    "engineer",
    "farmer",
    "lawyer",
    "astronomer",
)

# relation -> (subject type, object type, templates, extra phrasings). Phrasing i < 3 is
# template i followed by " {o}" and a tail, so every template has a passage form that ends
# in the object; phrasing 0 is stated for every fact, so the default prompt is answerable.
_RELATIONS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "born_in": (
        "person",
        "city",
        ("[X] was born in", "The birthplace of [X] is", "[X] came into the world in the city of"),
        (".", ", where the family lived for many years.", " during a cold winter."),
        ("{o} is the city where {s} was born.", "In {o}, a child named {s} was born."),
    ),
    "citizen_of": (
        "person",
        "country",
        ("[X] is a citizen of", "The nationality of [X] is that of", "[X] holds a passport from"),
        (".", ", as records show.", " and travels often."),
        ("{o} counts {s} among its citizens.", "As a citizen of {o}, {s} votes in every election."),
    ),
    "native_language": (
        "person",
        "language",
        ("The native language of [X] is", "[X] grew up speaking", "[X]'s mother tongue is"),
        (".", " at home.", ", according to friends."),
        ("{o} is the first language {s} learned.", "Speaking {o} since childhood, {s} writes poems in it."),
    ),
    "plays_instrument": (
        "person",
        "instrument",
        ("[X] plays the", "The instrument of [X] is the", "On stage, [X] performs on the"),
        (".", " in a small orchestra.", " every weekend."),
        (
            "The {o} is the instrument that {s} plays.",
            "Every evening the sound of the {o} comes from the house of {s}.",
        ),
    ),
    "occupation": (
        "person",
        "occupation",
        ("[X] works as a", "The profession of [X] is", "By trade, [X] is a"),
        (".", ", and a good one.", " in a busy town."),
        ("Being a {o} is how {s} earns a living.", "Trained as a {o}, {s} never changed careers."),
    ),
    "works_for": (
        "person",
        "company",
        ("[X] is employed by", "The employer of [X] is", "[X] has a job at"),
        (".", " for many years.", ", a large company."),
        ("{o} employs {s}.", "Colleagues at {o} know {s} well."),
    ),
    "capital": (
        "country",
        "city",
        ("The capital of [X] is", "[X] has its capital in", "The seat of government of [X] is"),
        (".", ", a large city.", ", by the river."),
        ("{o} is the capital of {s}.", "Visitors to {s} usually arrive in its capital, {o}."),
    ),
    "located_in": (
        "city",
        "country",
        ("[X] is a city in", "[X] is located in", "The city of [X] lies in the country of"),
        (".", ", near the border.", ", on the coast."),
        ("{o} is the country where the city of {s} lies.", "The map of {o} shows the city of {s}."),
    ),
    "official_language": (
        "country",
        "language",
        ("The official language of [X] is", "In [X], people officially speak", "[X] uses as its official language"),
        (".", " in schools and courts.", ", by law."),
        ("{o} is the official language of {s}.", "Laws in {s} are written in {o}."),
    ),
    "headquarters": (
        "company",
        "city",
        ("[X] is headquartered in", "The headquarters of [X] are in", "[X] has its main office in"),
        (".", ", close to the station.", ", in a tall building."),
        ("{o} is home to the headquarters of {s}.", "In {o}, the company {s} has its main office."),
    ),
}

_DISTRACTORS = {
    "person": (
        "{s} was mentioned in a local newspaper last spring.",
        "Nobody remembers where {s} was born.",
        "{s} rarely talks about work or music.",
        "A letter addressed to {s} arrived late.",
        "Friends say {s} enjoys long walks.",
        "{s} once gave a short speech at a wedding.",
    ),
    "city": (
        "{s} is known for its narrow streets.",
        "Tourists often visit {s} in the summer.",
        "The old bridge of {s} was repaired.",
        "A festival in {s} draws large crowds.",
    ),
    "country": (
        "{s} has a long coastline.",
        "Little is written about the history of {s}.",
        "The flag of {s} has three colours.",
        "Many rivers cross {s}.",
    ),
    "language": (
        "{s} has a rich tradition of poetry.",
        "Few dictionaries of {s} exist.",
        "Linguists still debate the grammar of {s}.",
    ),
    "company": (
        "{s} announced a new product line.",
        "The shares of {s} rose slightly.",
        "{s} held its yearly meeting in the spring.",
    ),
}

# share of `num_entities` per invented entity type (people are the most common subjects)
_TYPE_SHARES = (("person", 0.55), ("city", 0.2), ("country", 0.08), ("language", 0.07), ("company", 0.1))


def _pronounceable(rng: np.random.Generator, syllables: int) -> str:
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
    return s.capitalize()


def _invent_names(rng: np.random.Generator, kind: str, n: int, taken: set[str]) -> list[str]:
    """`n` unique names; no name is a word-prefix of another (keeps string matching exact)."""
    out = []
    while len(out) < n:
        if kind == "person":
            name = f"{_pronounceable(rng, 2)} {_pronounceable(rng, 2 + int(rng.random() < 0.3))}"
        elif kind == "language":
            name = _pronounceable(rng, 2) + str(rng.choice(("ish", "ese", "ic", "ian")))
        elif kind == "company":
            name = f"{_pronounceable(rng, 2)} {rng.choice(('Works', 'Industries', 'Trading', 'Mills', 'Labs'))}"
        else:
            name = _pronounceable(rng, int(rng.integers(2, 4)))
        low = name.lower()
        if any(low == t or low.startswith(t + " ") or t.startswith(low + " ") for t in taken) or len(name) < 4:
            continue
        taken.add(low)
        out.append(name)
    return out


def generate_embedded(
    cfg: corpus_lib.EmbeddedConfig, seed: int, eval_fraction: float = 0.05, max_examples: int = 0
) -> corpus_lib.Corpus:
    """Generates the embedded fact corpus (deterministic in `cfg` and `seed`).

    A consistent small world is drawn first (each country has a capital city located in it
    and an official language; people, cities and companies get random attributes), then
    `num_facts` facts are drawn round-robin over the relations. Each fact is stated by
    `phrasings_per_fact` passages in distinct phrasings (always including phrasing 0, the
    form of template 0); distractor passages mention entities but state no fact. Passages
    are shuffled once, which fixes their ids. Held-out passages for the eval loss are new
    phrasings of some facts plus new distractors, so every training passage stays.

    Raises:
      ValueError: a size that cannot be met, naming the `config.data.embedded.*` key.
    """
    n_phr = 3 + min(len(v[4]) for v in _RELATIONS.values())
    if not 1 <= cfg.phrasings_per_fact <= n_phr:
        raise ValueError(
            f"config.data.embedded.phrasings_per_fact must be in [1, {n_phr}], got {cfg.phrasings_per_fact}"
        )
    if cfg.num_entities < 20:
        raise ValueError(f"config.data.embedded.num_entities must be >= 20, got {cfg.num_entities}")
    if cfg.num_facts < 1 or cfg.num_distractors < 0:
        raise ValueError(
            "config.data.embedded.num_facts must be >= 1 and num_distractors >= 0, "
            f"got {cfg.num_facts} and {cfg.num_distractors}"
        )
    rng = np.random.default_rng([seed, 0x7AC5])
    taken: set[str] = set()
    ents = {}
    for kind, share in _TYPE_SHARES:
        ents[kind] = _invent_names(rng, kind, max(2, int(round(share * cfg.num_entities))), taken)
    ents["city"] += _invent_names(rng, "city", max(0, len(ents["country"]) - len(ents["city"])), taken)
    ents["instrument"], ents["occupation"] = list(_INSTRUMENTS), list(_OCCUPATIONS)

    # The world: one object per (relation, subject).
    countries, cities = ents["country"], ents["city"]
    capital = dict(zip(countries, rng.permutation(cities)[: len(countries)].tolist()))
    city_country = {c: str(rng.choice(countries)) for c in cities}
    city_country.update({city: country for country, city in capital.items()})
    world: dict[str, dict[str, str]] = {
        "capital": capital,
        "located_in": city_country,
        "official_language": {c: str(rng.choice(ents["language"])) for c in countries},
        "headquarters": {c: str(rng.choice(cities)) for c in ents["company"]},
    }
    for rel, (stype, otype, *_rest) in _RELATIONS.items():
        if stype == "person":
            world[rel] = {p: str(rng.choice(ents[otype])) for p in ents["person"]}
    total = sum(len(v) for v in world.values())
    if cfg.num_facts > total:
        raise ValueError(
            f"config.data.embedded.num_facts={cfg.num_facts} exceeds the {total} facts of a world "
            f"with num_entities={cfg.num_entities}"
        )

    # Facts, round-robin over relations in a seeded order.
    pools = {rel: rng.permutation(sorted(world[rel])).tolist() for rel in _RELATIONS}
    order = rng.permutation(sorted(_RELATIONS)).tolist()
    picked: list[tuple[str, str]] = []
    while len(picked) < cfg.num_facts:
        for rel in order:
            if pools[rel] and len(picked) < cfg.num_facts:
                picked.append((rel, pools[rel].pop()))

    def phrasings(rel: str) -> list[str]:
        _, _, templates, tails, extra = _RELATIONS[rel]
        return [t.replace("[X]", "{s}") + " {o}" + tail for t, tail in zip(templates, tails)] + list(extra)

    passages: list[tuple[str, int]] = []  # (text, fact index or -1)
    unused: list[list[str]] = []
    for fi, (rel, subj) in enumerate(picked):
        forms = phrasings(rel)
        rest = (1 + rng.permutation(len(forms) - 1)).tolist()
        chosen = [0] + rest[: cfg.phrasings_per_fact - 1]
        obj = world[rel][subj]
        passages += [(forms[k].format(s=subj, o=obj), fi) for k in chosen]
        unused.append([forms[k].format(s=subj, o=obj) for k in rest[cfg.phrasings_per_fact - 1 :]])

    def distractor() -> str:
        kind = str(rng.choice(list(_DISTRACTORS)))
        return str(rng.choice(_DISTRACTORS[kind])).format(s=rng.choice(ents[kind]))

    seen = {t for t, _ in passages}
    target, tries = len(passages) + cfg.num_distractors, 0
    while len(passages) < target:
        t, tries = distractor(), tries + 1
        if t in seen and tries < 50 * target:  # repeat only once the distractor space is spent
            continue
        seen.add(t)
        passages.append((t, -1))
    perm = rng.permutation(len(passages))
    passages = [passages[i] for i in perm]
    if max_examples:
        passages = passages[:max_examples]
    texts = [t for t, _ in passages]
    evidence: dict[int, list[int]] = {}
    for i, (_, fi) in enumerate(passages):
        if fi >= 0:
            evidence.setdefault(fi, []).append(i)
    facts = []
    for fi, (rel, subj) in enumerate(picked):
        if fi not in evidence:  # cut by max_examples
            continue
        obj = world[rel][subj]
        facts.append(
            corpus_lib.Fact(
                fact_id=f"emb-{fi:05d}",
                subject=subj,
                relation=rel,
                object=obj,
                object_aliases=(obj,),
                subject_aliases=(subj,),
                evidence_ids=tuple(evidence[fi]),
            )
        )
    templates = {rel: list(v[2]) for rel, v in _RELATIONS.items()}

    # Held-out passages: unused phrasings of some facts (does the model know the fact when
    # it is stated differently?) and fresh distractors (plain language modelling).
    n_eval = int(round(eval_fraction * len(texts)))
    eval_texts: list[str] = []
    fact_order = rng.permutation(len(picked)).tolist()
    for fi in fact_order:
        if len(eval_texts) >= n_eval // 2:
            break
        if unused[fi]:
            eval_texts.append(unused[fi][0])
    train_set = set(texts)
    tries = 0
    while len(eval_texts) < n_eval and tries < 100 * (n_eval + 1):
        tries += 1
        t = distractor()
        if t not in train_set and t not in eval_texts:
            eval_texts.append(t)
    return corpus_lib.make_corpus(f"embedded(seed={seed})", texts, facts, templates, eval_texts)


def fill_template(template: str, subject: str) -> str:
    """`"[X] was born in"`, `"Arlo Venmarsh"` -> `"Arlo Venmarsh was born in"`."""
    return template.replace("[X]", subject)
