"""What a serving process does with a published model: torch and torchrec only (no Lightning, no lightning_ett).

Builds the plain, unsharded DLRM of ett_job.py, loads PUBLISH_DIR/<latest>/model.pt into it and
compares its predictions on each rank's eval batch with the ones the sharded training model made.
Prints one JSON line: the version served, its step, the largest difference, the modules imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

KEYS = [f"f{i}" for i in range(4)]  # ett_job.py's model
DENSE = 8


def main() -> None:
    publish_dir, predictions_dir, rows = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    version = publish_dir / (publish_dir / "latest").read_text().strip()
    manifest = json.loads((version / "manifest.json").read_text())
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[k])
              for i, k in enumerate(KEYS)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=DENSE,
                 dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    model.load_state_dict(torch.load(version / "model.pt", weights_only=True), strict=True)
    model.eval()
    worst, steps = 0.0, set()
    for path in sorted(predictions_dir.glob("rank*.pt")):
        trained = torch.load(path, weights_only=True)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=trained["ids"], lengths=trained["lengths"])
        with torch.no_grad():
            served = model(trained["dense"], kjt).squeeze(-1)
        worst = max(worst, float((served - trained["predictions"]).abs().max()))
        steps.add(int(trained["global_step"]))
    print(json.dumps({"version": manifest["version"], "global_step": manifest["global_step"], "trained_steps": sorted(steps),
                      "max_abs_diff": worst, "ranks": len(list(predictions_dir.glob("rank*.pt"))),
                      "lightning_imported": any(m.split(".")[0] in ("lightning", "lightning_ett", "pytorch_lightning")
                                                for m in sys.modules)}))


if __name__ == "__main__":
    main()
