"""A trivial Ray job for the multi-host harness: one task per CPU of the cluster, spread over the nodes; each writes a
marker into its host's ~/.cache and reports its node's IP and which markers it sees. Prints one JSON line.

    ray job submit --address http://HEAD:PORT --working-dir . -- python tests/cluster/probe_job.py
"""

import json
import os
import sys
import time

import ray


@ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
def probe(i: int) -> dict:
    cache = os.path.expanduser("~/.cache")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f"probe_marker_{i}"), "w") as f:
        f.write(str(i))
    time.sleep(2)  # overlap with the other tasks, so SPREAD has to use every host
    seen = sorted(n for n in os.listdir(cache) if n.startswith("probe_marker_"))
    return {"i": i, "ip": ray.util.get_node_ip_address(), "seen": seen}


if __name__ == "__main__":
    ray.init()
    n = int(ray.cluster_resources().get("CPU", 0))
    results = ray.get([probe.remote(i) for i in range(n)])
    # the job's stdout is what `ray job submit` relays: the test reads this line
    sys.stdout.write("PROBE " + json.dumps({"driver_ip": ray.util.get_node_ip_address(), "tasks": results}) + "\n")
