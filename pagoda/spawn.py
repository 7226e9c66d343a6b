"""Starting pagoda's own processes with multiprocessing's spawn, from any program and any thread."""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.RLock()  # one start at a time: each hides and restores the same attributes


@contextlib.contextmanager
def main_module_not_rerun() -> Iterator[None]:
    """spawn runs the parent's main script again in each new process, by its path or module name, before the
    worker's function: a script without the `if __name__ == "__main__":` guard would start engines in its workers,
    and one read from standard input cannot be found at all. The workers run pagoda's own function on pagoda's own
    objects and need nothing of the main script, so it is hidden from spawn while they start."""
    with _lock:
        main = sys.modules.get("__main__")
        if main is None:
            yield
            return
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None  # spawn reads it, so it must exist
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
