"""Driver-side orchestration on Ray and the ``hybrid`` command line."""
