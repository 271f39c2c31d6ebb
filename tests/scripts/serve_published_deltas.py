"""A server that follows a publish directory version by version: the first full version, then each delta applied
to the version it holds (``apply_published_delta``: torch and lightning_ett's artifact loader, no Lightning).

Checks that the weights it ends with equal ``load_published`` of the latest version bit for bit, and that the plain
DLRM of ett_job.py with them predicts what the sharded training model did. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from serve_published import DENSE, KEYS
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_ett.publish.artifact import apply_published_delta, load_published, published_versions, read_manifest


def main() -> None:
    publish_dir, predictions_dir, rows = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    versions = published_versions(publish_dir)
    kinds = [(read_manifest(path) or {}).get("kind", "full") for _, path in versions]
    weights, manifest = load_published(versions[0][1])
    held = manifest["version"]
    for (number, path), kind in zip(versions[1:], kinds[1:]):
        if kind == "delta":
            manifest = apply_published_delta(weights, path, held)
        else:
            weights, manifest = load_published(path)
        held = number
    rebuilt, _ = load_published(publish_dir)
    same = set(rebuilt) == set(weights) and all(torch.equal(rebuilt[k], weights[k]) for k in weights)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[k])
              for i, k in enumerate(KEYS)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=DENSE,
                 dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    model.load_state_dict(weights, strict=True)
    model.eval()
    worst = 0.0
    for path in sorted(predictions_dir.glob("rank*.pt")):
        trained = torch.load(path, weights_only=True)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=trained["ids"], lengths=trained["lengths"])
        with torch.no_grad():
            worst = max(worst, float((model(trained["dense"], kjt).squeeze(-1) - trained["predictions"]).abs().max()))
    print(json.dumps({"kinds": kinds, "held": held, "global_step": manifest["global_step"], "same_as_rebuilt": same,
                      "max_abs_diff": worst,
                      "lightning_imported": any(m.split(".")[0] in ("lightning", "pytorch_lightning") for m in sys.modules)}))


if __name__ == "__main__":
    main()
