"""The exit status of every ``hybrid`` command: 0 success, 1 the job failed, 2 the user's input (a
``UserError`` or a usage error), 130 interrupted (SIGINT, SIGTERM, SIGHUP)."""

EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
