"""One module per ``hybrid`` sub-command; ``ALL_COMMANDS`` is what ``launch.cli`` registers."""

ALL_COMMANDS: list = []

from launch.commands.estimate import estimate  # noqa: E402
from launch.commands.monitor import monitor  # noqa: E402

ALL_COMMANDS += [estimate, monitor]

from launch.commands.launch import launch_command  # noqa: E402
from launch.commands.plan import plan_command  # noqa: E402

ALL_COMMANDS += [plan_command, launch_command]

from launch.commands.checkpoint import checkpoint_group  # noqa: E402

ALL_COMMANDS += [checkpoint_group]
