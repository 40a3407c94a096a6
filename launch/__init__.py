"""Driver-side orchestration on Ray and the ``hybrid`` command line.

- ``cli`` and ``commands/``: the ``hybrid`` command line, one module per command; ``exit_codes``.
- ``spec``: cluster.yaml, loaded and checked.
- ``planning/``: what the launcher knows of the model, the plan, and the closed memory loop.
- ``ray/``: everything that talks to Ray (cluster, rank actors, runtime env, probes, watchdog).
- ``job/``: one job on the driver (driver, display, metrics, logs, signals).

Modules that moved when the folders were introduced still import under their old names (``MOVED``).
"""

from hybrid import register_moved

MOVED = {
    'launch.ray_cluster': 'launch.ray.cluster',
    'launch.workers': 'launch.ray.workers',
    'launch.runtime_env': 'launch.ray.runtime_env',
    'launch.reaper': 'launch.ray.reaper',
    'launch.embedded_processes': 'launch.ray.embedded_processes',
    'launch.probe': 'launch.ray.probe',
    'launch.capacity': 'launch.ray.capacity',
    'launch.working_dir_check': 'launch.ray.working_dir_check',
    'launch.metrics': 'launch.job.metrics',
    'launch.display': 'launch.job.display',
    'launch.memory_view': 'launch.job.memory_view',
    'launch.signals': 'launch.job.signals',
    'launch.log_forwarding': 'launch.job.log_forwarding',
    'launch.plan': 'launch.planning.plan',
    'launch.model_size': 'launch.planning.model_size',
    'launch.replan': 'launch.planning.replan',
    'launch.memory_loop': 'launch.planning.memory_loop',
}
register_moved(MOVED)
