"""The planner's learned state on disk (`--state FILE`): read at start, written after every decision
(a temporary file renamed over it: a crash leaves the old state or the new, never half of one)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from planner.decision import Planner


def resume(planner: Planner, path: str | Path) -> bool:
    """`planner.resume` from the file if it exists (False if not). A file that is not a state this
    planner can take raises ValueError naming it and why."""
    path = Path(path)
    if not path.exists():
        return False
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
        planner.resume(state)
    except (ValueError, OSError) as e:  # (json's errors are ValueErrors)
        raise ValueError(f"planner state {path}: {e} (delete it to start learning afresh)") from e
    return True


def save(planner: Planner, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(planner.learned(), indent=1))
    os.replace(tmp, path)
