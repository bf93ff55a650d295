"""The linear datamodeling score of the T-REx run (experiments/trex_table1.py), every row.

    python -m launch.validate --config=experiments/trex_lds.py:gpu --workdir=runs/trex_table1_gpu \
        --subset_counts=10,20,30,50
    # several machines: add --process_index=i --process_count=n to each (subsets i % n == index)

The run sections are trex_table1's own variant (`:cpu` default, `:gpu`), so it validates that
run in place (launch.validate refuses a workdir whose run differs, naming the field). Only the
`validate` section is added: M=50 subsets of half the corpus (TRAK's M and alpha), each
retrained from the run's initialisation for its full schedule, scored on the table's queries.
On one GPU the 14.7M-parameter gpu model is retrained 10 subsets side by side (vmap; the
batch is 10 x 128 x 128 tokens), the cpu variant 5 at a time (M=50 splits into whole groups).
"""

from experiments import trex_table1


def get_config(arg: str | None = None):
    arg = arg or "cpu"
    c = trex_table1.get_config(arg)
    c.validate.num_subsets = 50
    c.validate.fraction = 0.5
    c.validate.num_steps = 0  # the run's full schedule
    c.validate.methods = trex_table1.ALL_METHODS  # dense needs its model package (see trex_table1)
    c.validate.num_queries = 200 if arg == "cpu" else 500
    c.validate.parallel_subsets = 5 if arg == "cpu" else 10
    return c
