"""One gloo all-reduce across the job's ranks; each rank writes what it saw to OUT/rank<r>.json.

For the two-host tests: which store address and gloo interface a worker was given, and that they work.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
facts = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item(),
         "master_addr": os.environ.get("MASTER_ADDR"), "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
         "interfaces": [name for _, name in socket.if_nameindex()]}  # which host it ran on
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(facts, f)
dist.destroy_process_group()
