"""Prompt templates per relation (§A.4, Table A.1): the paper's style, LAMA / ParaRel, the subject inside.

A template is a prompt head with one `[X]` (the subject) that ends right before the object:
"[X] was born in the city of:". Variants, in the order Table A.1 uses them:

  0. the paper's style: ends with a colon and names the answer type, so that a left-to-right
     model is constrained to answer the fact ("[X] is located in the following country:").
     Written for every relation of LAMA's `relations.jsonl` (46 relations, all 41 of LAMA
     T-REx) from its label and description, shipped in `lama_templates.jsonl` beside this module.
  1. LAMA's template (`relations.jsonl`) cut before `[Y]` when the object ends it ("[X] was
     born in"), else the first ParaRel paraphrase that starts with the subject and ends with
     the object (the paper's "second set": no colon, no constraining words).
  2. a form whose subject is not first ("The birthplace of [X] is"), shipped with variant 0.
  3+. the other ParaRel paraphrases that end with the object (more phrasings for the
     corpus's templated statements; never queried by default).

A user's own file (`config.data.templates_file`, the same jsonl format as the shipped file:
`{"relation": "P19", "templates": {"0": "...", "1": "...", "2": "..."}}`, any subset of
variants) adds relations or overrides variants of shipped ones.
"""

from __future__ import annotations

import pathlib
from typing import Iterable, Mapping, Sequence

from trackstar_jax import files
from trackstar_jax.data import answers

PACKAGED_FILE = pathlib.Path(__file__).with_name("lama_templates.jsonl")
NUM_VARIANTS = 3  # variants 0-2 are required for every relation (Table A.1's three sets)


def head(template: str) -> str:
    """The template cut right before `[Y]` (a template without `[Y]` is already a head)."""
    return template.split("[Y]", 1)[0].rstrip() if "[Y]" in template else template.rstrip()


def ends_with_object(pattern: str) -> bool:
    """True when nothing but punctuation follows `[Y]`: the object completes the sentence."""
    return "[Y]" in pattern and not answers.words(pattern.split("[Y]", 1)[1])


def render(template: str, subject: str) -> str:
    """Fills `[X]` with the subject and cuts before `[Y]`; the first letter is capitalised.

    Raises:
      ValueError: the template has no `[X]` slot.
    """
    if "[X]" not in template:
        raise ValueError(f"template {template!r} has no [X] slot for the subject")
    prompt = head(template).replace("[X]", subject).strip()
    return prompt[:1].upper() + prompt[1:]


def statement(template: str, subject: str, obj: str) -> str:
    """A templated statement of a fact: the rendered prompt, " " + object, and a full stop."""
    return f"{render(template, subject)} {obj}."


def check_template(template: str, where: str) -> str:
    """A prompt head with exactly one `[X]` and no `[Y]` before its end, or a ValueError naming `where`."""
    if not isinstance(template, str) or template.count("[X]") != 1:
        raise ValueError(f"{where}: template {template!r} must hold exactly one [X]")
    if "[Y]" in template and not ends_with_object(template):
        raise ValueError(f"{where}: template {template!r} must end with [Y] (the object completes the prompt)")
    return head(template)


def read_templates_file(path: str | pathlib.Path) -> dict[str, dict[int, str]]:
    """`{relation: {variant: head}}` from a jsonl of `{"relation", "templates": {"0": ..., ...}}`.

    Raises:
      FileNotFoundError: no such file. files.InputError / ValueError: a bad line (names file:line).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"templates file not found: {path}")
    out: dict[str, dict[int, str]] = {}
    for where, row in files.read_jsonl(path):
        rel = row.get("relation") if isinstance(row, dict) else None
        tmpl = row.get("templates") if isinstance(row, dict) else None
        if not isinstance(rel, str) or not isinstance(tmpl, dict) or not tmpl:
            raise files.InputError(
                f'{where}: expected {{"relation": "P19", "templates": {{"0": "[X] was born in the city of:", ...}}}}'
            )
        variants = out.setdefault(rel, {})
        for k, t in tmpl.items():
            if not str(k).isdigit():
                raise files.InputError(f"{where}: template variant {k!r} of {rel} is not a number")
            variants[int(k)] = check_template(t, f"{where} ({rel} variant {k})")
    return out


def _lama_file_templates(lama_dir: str | pathlib.Path | None) -> dict[str, str]:
    if lama_dir is None:
        return {}
    root = pathlib.Path(lama_dir)
    f = root / "relations.jsonl" if (root / "relations.jsonl").is_file() else root.parent / "relations.jsonl"
    if not f.is_file():
        return {}
    out = {}
    for where, row in files.read_jsonl(f):
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("relation"), str)
            or not isinstance(row.get("template"), str)
        ):
            raise files.InputError(f"{where}: expected string fields 'relation' and 'template'")
        out[row["relation"]] = row["template"]
    return out


def _pararel_patterns(pararel_dir: str | pathlib.Path | None, relation: str) -> list[str]:
    """ParaRel paraphrases of `relation` whose object ends the sentence and whose subject comes first in it."""
    if pararel_dir is None:
        return []
    d = pathlib.Path(pararel_dir)
    d = d / "patterns" if (d / "patterns").is_dir() else d
    f = d / f"{relation}.jsonl"
    if not f.is_file():
        return []
    out = []
    for where, row in files.read_jsonl(f):
        pattern = row.get("pattern") if isinstance(row, dict) else None
        if not isinstance(pattern, str):
            raise files.InputError(f"{where}: expected a string field 'pattern'")
        if ends_with_object(pattern) and pattern.count("[X]") == 1 and "[X]" in pattern.split("[Y]", 1)[0]:
            out.append(head(pattern))
    return out


def _dedupe(cands: Iterable[str]) -> list[str]:
    out, seen = [], set()
    for c in cands:
        key = " ".join(c.lower().split())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def load(
    relations: Sequence[str],
    *,
    lama_dir: str | pathlib.Path | None = None,
    pararel_dir: str | pathlib.Path | None = None,
    user_file: str | pathlib.Path | None = None,
) -> dict[str, list[str]]:
    """Templates per relation in variant order (see the module docstring).

    Args:
      relations: relation ids to load.
      lama_dir: folder with LAMA's `relations.jsonl` (or its `TREx/` subfolder); None = none.
      pararel_dir: ParaRel `patterns/` folder (or its parent); None = none.
      user_file: the user's templates file (adds / overrides per relation and variant).

    Returns:
      `{relation: [head_0, head_1, head_2, head_3, ...]}` (heads keep `[X]`).

    Raises:
      ValueError: a relation lacks one of variants 0-2 in every source (names the relation,
        the variant and where it looked).
    """
    given = read_templates_file(PACKAGED_FILE)
    if user_file:
        for rel, variants in read_templates_file(user_file).items():
            given.setdefault(rel, {}).update(variants)
    lama = _lama_file_templates(lama_dir)
    out = {}
    for rel in relations:
        own = given.get(rel, {})
        para = _pararel_patterns(pararel_dir, rel)
        v1 = own.get(1)
        if v1 is None and rel in lama and ends_with_object(lama[rel]) and "[X]" in lama[rel]:
            v1 = head(lama[rel])
        if v1 is None:
            v1 = next((p for p in para if p.startswith("[X]")), None)
        heads = [own.get(0), v1, own.get(2)]
        missing = [i for i, h in enumerate(heads) if h is None]
        if missing:
            looked = [str(PACKAGED_FILE)] + [str(p) for p in (user_file, lama_dir, pararel_dir) if p]
            raise ValueError(
                f"relation {rel!r} has no prompt template variant(s) {missing} (looked in {', '.join(looked)}); "
                f'add a line {{"relation": "{rel}", "templates": {{"0": "[X] ...:", "1": "[X] ...", '
                f'"2": "The ... of [X] is"}}}} to a file named by config.data.templates_file'
            )
        extra = [own[k] for k in sorted(own) if k >= NUM_VARIANTS] + para
        seen = {" ".join(h.lower().split()) for h in heads}
        out[rel] = heads + [t for t in _dedupe(extra) if " ".join(t.lower().split()) not in seen]
    return out


def statement_ids(corpus) -> frozenset[int]:
    """Ids of the corpus's templated statements (`Corpus` with templates and split facts).

    A passage is one when its text is a train fact's `statement` in any of its relation's
    templates; found by text, so it does not depend on how ids were assigned.
    """
    if not corpus.templates:
        return frozenset()
    ids = {t: i for i, t in enumerate(corpus.texts)}
    out = set()
    for f in corpus.facts:
        if f.split != "train":
            continue
        for h in corpus.templates.get(f.relation, ()):
            i = ids.get(statement(h, f.subject, f.object))
            if i is not None:
                out.add(i)
    return frozenset(out)


def template_for(templates: Mapping[str, Sequence[str]], relation: str, variant: int) -> str:
    """`templates[relation][variant]`, or a ValueError naming the relation and what exists."""
    if relation not in templates or not templates[relation]:
        raise ValueError(
            f"relation {relation!r} has no prompt template (templates exist for: "
            f"{', '.join(sorted(templates)) or 'none'})"
        )
    if not 0 <= variant < len(templates[relation]):
        raise ValueError(
            f"relation {relation!r} has no template variant {variant}: only "
            f"{len(templates[relation])} template(s): {list(templates[relation])}"
        )
    return templates[relation][variant]
