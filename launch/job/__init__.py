"""One job on the driver: ``driver`` (cluster -> plan -> ranks -> progress -> summary, failures and
restarts), what it shows (``display``, ``memory_view``), what it records (``metrics``), the ranks' output
(``log_forwarding``) and the signals it turns into a clean stop (``signals``)."""
