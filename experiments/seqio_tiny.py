"""tiny.py on a registered seqio Mixture: the demo Tasks of experiments/seqio_demo/tasks.py.

Needs the `seqio` extra and the demo files (docs/seqio.md):
  python -m experiments.seqio_demo.make_data runs/seqio_demo_data
  python -m launch.train --config=experiments/seqio_tiny.py --workdir=runs/seqio_tiny
Loading this config imports neither seqio nor the Tasks; the train stage does.
"""

from experiments import tiny


def get_config(arg: str | None = None):
    c = tiny.get_config(arg)
    c.data.source = "seqio"
    c.data.seqio_task = "trackstar_demo_mix"  # a Mixture: every Task with a rate > 0, each example once
    c.data.seqio_split = "train"
    c.data.seqio_module = "experiments.seqio_demo.tasks"  # imported to register the Tasks
    c.data.text_key = "text"  # token ids after seqio's tokenize; its `text_pretokenized` copy is the passage
    c.train.num_steps = 100
    c.train.warmup_steps = 20
    c.train.eval_every_steps = 50
    c.train.checkpoint_every_steps = 50
    return c
