"""The package's arrows run one way: callbacks and strategies use the subsystems, every subsystem the instrument.

Checked from the source (the imports each module makes), so a new module that reaches the
wrong way fails here, not in review.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from conftest import REPO, run_script

PACKAGE = REPO / "lightning_ett"
#: What each part may import from the package (besides itself). ``durable`` and ``patching``
#: are the foundation: nothing of the package.
ALLOWED: dict[str, set[str]] = {
    "durable": set(),
    "patching": set(),
    "instrument": {"durable"},
    "compile": {"durable", "instrument", "patching"},
    "checkpoint": {"durable", "instrument", "patching"},
    "publish": {"durable", "instrument", "checkpoint"},
    "watch": {"durable", "instrument"},
    "fp8": {"durable", "instrument"},
    "lifecycle": {"durable", "instrument"},
    "launch": {"durable", "instrument", "watch", "tune", "lifecycle"},
    "tune": {"durable", "instrument", "checkpoint"},
    "strategies": {"durable", "instrument", "patching", "checkpoint"},
    "callbacks": {"durable", "instrument", "patching", "checkpoint", "publish", "compile", "lifecycle", "watch", "fp8"},
}
#: Third-party packages the instrument must not import (``lightning-ett report`` runs without them).
HEAVY = ("lightning", "torchrec", "wandb", "torch", "fbgemm_gpu")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "lightning_ett"]
        found += [(name, id(node) in top) for name in names]
    return found


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_every_import_inside_the_package_follows_the_arrows():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        if part == "__init__":
            continue  # the public API: lazily re-exports callbacks and strategies
        for module, _ in _imports(path):
            if module.startswith("lightning_ett."):
                target = module.split(".")[1]
                if target != part and target not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_instrument_imports_no_framework_at_module_level_and_the_report_runs_without_them(tmp_path):
    for path in sorted((PACKAGE / "instrument").glob("*.py")):
        heavy = [m for m, top in _imports(path) if top and m.split(".")[0] in HEAVY]
        assert not heavy or path.name == "compile_events.py", (path.name, heavy)  # torch only inside compile_tracker()
    ledger = tmp_path / "ledger" / "attempt-0000"
    ledger.mkdir(parents=True)
    (ledger / "rank-00000.jsonl").write_text(json.dumps({"kind": "event", "phase": "train", "start": 1.0, "end": 3.0,
                                                         "rank": 0, "attempt": 0, "step": 0}) + "\n")
    code = ("import sys; from lightning_ett.launch.cli import main; code = main(['report', sys.argv[1]]); "
            "loaded = sorted(m for m in ('lightning', 'torchrec', 'torch', 'wandb') if m in sys.modules); "
            "print('LOADED', loaded); sys.exit(code)")
    proc = run_script("-c", code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout
