"""One module per ``hybrid`` sub-command; ``ALL_COMMANDS`` is what ``launch.cli`` registers."""

from launch.commands.checkpoint import checkpoint_group
from launch.commands.data import data_group
from launch.commands.estimate import estimate
from launch.commands.launch import launch_command
from launch.commands.monitor import monitor
from launch.commands.plan import plan_command
from launch.commands.probe import probe_command

ALL_COMMANDS: list = [estimate, plan_command, probe_command, launch_command, monitor, checkpoint_group, data_group]
