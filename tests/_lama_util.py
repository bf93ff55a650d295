"""A synthetic LAMA-format folder (TREx/<relation>.jsonl + relations.jsonl) for tests."""

import json
import pathlib

CITIES = ("Paris", "Rome", "Berlin", "Madrid", "Vienna", "Lisbon", "Prague", "Oslo")
TEMPLATES = {
    "P36": "The capital of [X] is [Y] .",
    "P37": "The official language of [X] is [Y] .",
    "P19": "[X] was born in [Y] .",
}


def write_lama(
    root: pathlib.Path, relations=("P19",), facts_per_relation: int = 12, sentences: int = 1
) -> pathlib.Path:
    """`root` with one file per relation; fact i of relation r has `sentences` evidence sentences."""
    (root / "TREx").mkdir(parents=True, exist_ok=True)
    (root / "relations.jsonl").write_text(
        "".join(
            json.dumps({"relation": r, "template": TEMPLATES.get(r, "[X] relates to [Y] .")}) + "\n" for r in relations
        )
    )
    for r in relations:
        lines = []
        for i in range(facts_per_relation):
            obj = CITIES[i % len(CITIES)]
            ev = [
                {"masked_sentence": f"Entity{r}{i} is tied to [MASK] since {1900 + 7 * i + j}.", "obj_surface": obj}
                for j in range(sentences)
            ]
            rec = {
                "uuid": f"{r}-{i}",
                "predicate_id": r,
                "sub_label": f"Entity{r}{i}",
                "obj_label": obj,
                "sub_uri": f"Q{i}",
                "obj_uri": f"Q{1000 + i % len(CITIES)}",
                "evidences": ev,
            }
            lines.append(json.dumps(rec))
        (root / "TREx" / f"{r}.jsonl").write_text("\n".join(lines) + "\n")
    return root
