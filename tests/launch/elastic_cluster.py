"""A local multi-node Ray cluster (``ray.cluster_utils.Cluster`` through ``launch.ray.cluster.local_cluster``:
loopback only, its own temp dir, torn down on exit) that a test drives over stdin, in a process of its own so
that the test process holds no Ray state of it.

``python -m tests.launch.elastic_cluster NODES`` prints ``address <gcs address>`` once every node is up, then
answers one line per command: ``remove`` (a node that is not the head: ``removed <node id>``),
``add`` (a node like the others: ``added <node id>``), ``quit`` (or end of input: the cluster is torn down).
"""

import sys

from launch.ray import cluster as ray_cluster


def main(nodes: int) -> None:
    with ray_cluster.local_cluster(nodes, 1) as cluster:
        print(f"address {cluster.address}", flush=True)
        added = nodes
        for line in sys.stdin:
            command = line.strip()
            if command == "remove":
                node = list(cluster.worker_nodes)[-1]
                cluster.remove_node(node)
                print(f"removed {node.node_id}", flush=True)
            elif command == "add":
                node = cluster.add_node(**ray_cluster._node_args(added, 1, head=False))
                added += 1
                cluster.wait_for_nodes()
                print(f"added {node.node_id}", flush=True)
            elif command == "quit":
                break


if __name__ == "__main__":
    main(int(sys.argv[1]))
