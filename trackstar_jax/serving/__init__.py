"""The proponent explorer: a local web app over a trained, indexed run.

- `engine`: the loaded run, indices and scoring; one query = `retrieve_queries` for one query.
- `app`: the Starlette routes (`make_app(engine)`) and the static page (`static/index.html`).

Needs the `serve` extra (starlette, uvicorn). Launch: `python -m launch.serve`.
"""
