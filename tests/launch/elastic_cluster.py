"""A local multi-node Ray cluster (``ray.cluster_utils.Cluster`` through ``launch.ray.cluster.local_cluster``:
loopback only, its own temp dir, torn down on exit) that a test drives over stdin, in a process of its own so
that the test process holds no Ray state of it.

``python -m tests.launch.elastic_cluster NODES`` prints ``address <gcs address>`` once every node is up, then
answers one line per command: ``remove`` (a node that is not the head, once Ray lists it dead:
``removed <node id>``), ``add`` (a node like the others, once it has run a task that imports torch as a rank
does: ``added <node id>``), ``join`` (the same, once the GCS lists it alive: a node joining under a running
job), ``quit`` (or end of input: the cluster is torn down).

Why ``add`` waits for a task: a node the GCS lists alive is not yet sure to run a rank. The first worker a
fresh node started for a rank died loading torch ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so",
then "Worker unexpectedly exits with a connection error code 2") in test runs, and the job's next attempt on
it worked; the task takes that first start (Ray retries a task whose worker died).
"""

import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from launch.ray import cluster as ray_cluster

READY_TIMEOUT_S = 180.0  # a node's first torch import, on 2 shared cores beside other tests


@ray.remote(num_cpus=0, max_retries=5)
def _imports_torch() -> str:
    import torch

    return torch.__version__


def runs_a_task(node_id: str) -> None:
    """Until a task pinned to ``node_id`` has imported torch there."""
    pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
    ray.get(_imports_torch.options(scheduling_strategy=pinned).remote(), timeout=READY_TIMEOUT_S)


def listed_dead(node_id: str, timeout_s: float = 60.0) -> None:
    """Until Ray no longer lists ``node_id`` alive."""
    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.1)


def main(nodes: int) -> None:
    with ray_cluster.local_cluster(nodes, 1) as cluster:
        print(f"address {cluster.address}", flush=True)
        added = nodes
        for line in sys.stdin:
            command = line.strip()
            if command == "remove":
                node = list(cluster.worker_nodes)[-1]
                cluster.remove_node(node)
                listed_dead(node.node_id)
                print(f"removed {node.node_id}", flush=True)
            elif command in ("add", "join"):
                node = cluster.add_node(**ray_cluster._node_args(added, 1, head=False))
                added += 1
                cluster.wait_for_nodes()
                if command == "add":
                    runs_a_task(node.node_id)
                print(f"added {node.node_id}", flush=True)
            elif command == "quit":
                break


if __name__ == "__main__":
    main(int(sys.argv[1]))
