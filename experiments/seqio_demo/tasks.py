"""seqio Tasks and a Mixture registered the way a T5X user does (copy this module as a template).

Importing it registers, over the text files `make_data.py` writes into `$TRACKSTAR_SEQIO_DATA`
(default `runs/seqio_demo_data`, relative to the working directory):

  * `trackstar_demo_facts`: `TextLineDataSource` over `facts-*.txt` (two shards, one passage
    per line) -> `lines_to_text` -> `seqio.preprocessors.tokenize` -> `append_eos`, with a
    `SentencePieceVocabulary` over `spm.model` (trained on the same text).
  * `trackstar_demo_other`: the same over `other-*.txt` (passages that state no fact).
  * `trackstar_demo_mix`: a Mixture of the two (rates 3 : 1).

Point the pipeline at one with `--config.data.source=seqio --config.data.seqio_task=<name>
--config.data.seqio_module=experiments.seqio_demo.tasks` (or `--config=experiments/seqio_tiny.py`).
`tokenize` keeps the raw line as `text_pretokenized`, which becomes the passage; the model
trains its own tokenizer on it, as for every source.
"""

import os

import seqio

DATA_DIR = os.environ.get("TRACKSTAR_SEQIO_DATA", os.path.join("runs", "seqio_demo_data"))
VOCABULARY = seqio.SentencePieceVocabulary(os.path.join(DATA_DIR, "spm.model"))
OUTPUT_FEATURES = {"text": seqio.Feature(vocabulary=VOCABULARY, add_eos=True)}
TASKS = {"trackstar_demo_facts": "facts-*.txt", "trackstar_demo_other": "other-*.txt"}
MIXTURE = "trackstar_demo_mix"


@seqio.map_over_dataset
def lines_to_text(line):
    """A text line (tf.string scalar) -> the feature dict the tokenizer reads."""
    return {"text": line}


for _name, _pattern in TASKS.items():
    seqio.TaskRegistry.add(
        _name,
        source=seqio.TextLineDataSource(split_to_filepattern={"train": os.path.join(DATA_DIR, _pattern)}),
        preprocessors=[lines_to_text, seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
        output_features=OUTPUT_FEATURES,
    )
seqio.MixtureRegistry.add(MIXTURE, [("trackstar_demo_facts", 3.0), ("trackstar_demo_other", 1.0)])
