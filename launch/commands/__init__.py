"""One module per ``hybrid`` sub-command; ``ALL_COMMANDS`` is what ``launch.cli`` registers."""

ALL_COMMANDS: list = []
