"""Writes the JSON Schema files of the message contracts (schemas step).

The files in ``schemas/json/`` are generated from the pydantic models, never
edited by hand; ``tests/test_schemas.py`` fails when they drift.

Example::

    $ python -m genrec.schemas.generate          # rewrite schemas/json/*.json
    $ python -m genrec.schemas.generate --check  # exit 1 if any file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from genrec.schemas.events import DeadLetter, UserEvent
from genrec.schemas.recommendations import RecommendationMessage

JSON_DIR = Path(__file__).resolve().parent / "json"
MODELS: dict[str, type[BaseModel]] = {
    "user_event.schema.json": UserEvent,
    "dead_letter.schema.json": DeadLetter,
    "recommendation.schema.json": RecommendationMessage,
}


def render(model: type[BaseModel]) -> str:
    """The JSON Schema of what a producer may send (validation mode), as stable text."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    schema.update(model.model_json_schema(mode="validation"))
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def stale_files(json_dir: Path = JSON_DIR) -> list[str]:
    """Names of schema files that are missing or differ from the models."""
    stale = []
    for name, model in MODELS.items():
        path = json_dir / name
        if not path.exists() or path.read_text() != render(model):
            stale.append(name)
    return stale


def write_all(json_dir: Path = JSON_DIR) -> list[Path]:
    json_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in MODELS.items():
        path = json_dir / name
        path.write_text(render(model))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {JSON_DIR / name} (run python -m genrec.schemas.generate)")
        return 1 if stale else 0
    for path in write_all():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
