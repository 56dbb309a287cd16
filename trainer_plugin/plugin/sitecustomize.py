"""obd's sitecustomize: under obd, every transformers.Trainer gets the SnapshotCallback with no change to the script.

obd copies this file to `<run dir>/plugin/sitecustomize.py` and puts that directory first on
PYTHONPATH, which hides any other `sitecustomize` the interpreter would have run: so this one
always runs the next one on sys.path. Outside obd (no OBD_RUN_DIR) it only does that chaining
and imports nothing else; under obd it installs a lazy import hook (transformers is not imported
here).
"""

import os
import sys


def _obd_install() -> None:
    if not os.environ.get("OBD_RUN_DIR"):
        return
    try:
        from trainer_plugin.plugin import inject

        inject.install()
    except Exception as exc:
        sys.stderr.write(f"obd: trainer plugin not installed ({type(exc).__name__}: {exc})\n")


def _obd_later_path_entries() -> list:
    """The sys.path entries after the one this file was loaded from (the ones it shadows)."""
    here = os.path.dirname(os.path.realpath(__file__))
    for index, entry in enumerate(sys.path):
        try:
            if os.path.realpath(entry or os.curdir) == here:
                return sys.path[index + 1 :]
        except (OSError, ValueError):
            continue
    return [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]


def _obd_chain() -> None:
    """Run the sitecustomize that this one hides, like site.py would have, reporting (not raising) its errors."""
    import importlib.machinery
    import importlib.util

    spec = None
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _obd_later_path_entries())
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_obd_chained_sitecustomize"] = module
    except Exception as exc:
        sys.stderr.write(f"Error in sitecustomize {getattr(spec, 'origin', '?')}: {type(exc).__name__}: {exc}\n")


# Ours first, so that a chained sitecustomize that imports transformers still gets it patched.
_obd_install()
_obd_chain()
