"""absl-flag launchers, one per pipeline stage: `python -m launch.<stage> --config=... --workdir=...`."""
