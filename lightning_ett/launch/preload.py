"""Imported by ``lightning run``'s forkserver: the modules every worker would import anyway.

A module of its own because the forkserver survives only ``ImportError`` from the modules it
preloads: any other error (a native library that does not load) would kill it, and with it
every worker start. Here each import fails alone, with a warning.

It is the forkserver's first code of ours, so it also ties the forkserver's life to the
launcher's (:mod:`lightning_ett.lifecycle.lifeline`): a SIGKILLed launcher leaves no forkserver behind.
"""

from __future__ import annotations

import importlib
import os
import warnings

from lightning_ett.launch.worker import ENV_PRELOAD, PRELOAD
from lightning_ett.lifecycle.lifeline import hold_on_to_launcher

hold_on_to_launcher(forks=True)  # before the imports: a launcher may die during them
for _name in filter(None, os.environ.get(ENV_PRELOAD, ",".join(PRELOAD)).split(",")):
    try:
        importlib.import_module(_name)
    except ImportError:
        pass  # not installed: the script would not import it either
    except Exception as _err:  # noqa: BLE001 - a broken optional import must not stop the job
        warnings.warn(f"lightning run: preloading {_name!r} failed ({_err!r}); workers will import it themselves.",
                      stacklevel=1)
