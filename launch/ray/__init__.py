"""Everything that talks to Ray: the cluster (embedded or remote), the rank actors and their runtime
environment, the per-node probes, and the watchdog that cleans up an embedded cluster.

Nothing outside this package imports Ray, except ``launch.job.driver``, which runs a job on it.
"""
