"""The suite's xdist scheduling (tests/scheduling.py): which tests go together, and in what order."""

import re
from pathlib import Path

from tests.scheduling import SHARED_CLUSTER_FILES, SHARED_CLUSTER_UNIT, tier, unit_of

ROOT = Path(__file__).resolve().parents[2]


def test_the_files_sharing_the_package_cluster_are_one_unit_and_every_other_file_its_own():
    assert {unit_of(f"{path}::test_x[1]") for path in SHARED_CLUSTER_FILES} == {SHARED_CLUSTER_UNIT}
    assert unit_of("tests/launch/test_launch_cli.py::test_y") == "tests/launch/test_launch_cli.py"
    assert unit_of("tests/unit/test_memory.py::test_z[a::b]") == "tests/unit/test_memory.py"


def test_the_shared_cluster_files_are_exactly_those_whose_tests_take_the_cluster_fixture():
    takes_it = re.compile(r"def test_\w+\((\w+, )*cluster\b")
    users = {f"tests/launch/{p.name}" for p in (ROOT / "tests" / "launch").glob("test_*.py")
             if takes_it.search(p.read_text())}
    assert users == SHARED_CLUSTER_FILES


def test_units_go_out_launch_first_and_unit_tests_last():
    order = sorted(["tests/unit/test_a.py", "tests/dist/test_b.py", "tests/launch/test_launch_cli.py",
                    SHARED_CLUSTER_UNIT, "tests/gpu/test_c.py"], key=tier)
    assert order == [SHARED_CLUSTER_UNIT, "tests/launch/test_launch_cli.py", "tests/dist/test_b.py",
                     "tests/gpu/test_c.py", "tests/unit/test_a.py"]
