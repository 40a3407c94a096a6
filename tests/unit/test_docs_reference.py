"""The generated reference pages (docs/reference/) are what ``python -m launch.docs`` writes from the code now, and
they say what the code does: a schema field's default, check and help, a command's options."""

from __future__ import annotations

import dataclasses

from launch import docs


def test_the_committed_reference_pages_are_what_the_generator_writes_now():
    differ = docs.stale()
    assert not differ, (f"{', '.join(differ)} differ from the code's schema and commands; run `{docs.COMMAND}` "
                        "(from the repository root, with .venv/bin/python) and commit the result")


def test_every_key_of_every_cluster_file_section_is_on_the_page_with_its_default():
    from launch.spec import CheckpointSpec, ClusterSpec, JobSpec, ParallelSpec

    page = docs.render()[docs.CLUSTER_PAGE]
    for section, cls in (("cluster", ClusterSpec), ("job", JobSpec), ("job.checkpoint", CheckpointSpec),
                         ("parallel", ParallelSpec)):
        assert f"## `{section}`" in page
        for f in dataclasses.fields(cls):
            s = f.metadata["hybrid.setting"]
            if not s.derived:
                assert f"| `{s.key or f.name}`" in page, f"{section}.{f.name} is missing from {docs.CLUSTER_PAGE}"
    assert "| `micro_batch` | `8` |" in page
    assert "| `collective_timeout_s` | `300` | a number from 1 to 604800 seconds |" in page  # the check's words
    assert "| `zero_stage` | auto | 'auto' or 0, 1, 2 or 3 |" in page
    assert "micro_batch_auto" not in page  # derived by the reader, never written


def test_accepts_is_the_check_s_own_sentence():
    from launch.spec import ClusterSpec

    s = next(f for f in dataclasses.fields(ClusterSpec) if f.name == "nodes").metadata["hybrid.setting"]
    assert docs.accepts("cluster.nodes", s) == "a whole number from 1 to 100000"


def test_every_command_and_option_is_on_the_cli_page():
    import click

    from launch.cli import _register, cli

    _register()
    page = docs.render()[docs.CLI_PAGE]

    def walk(cmd, ctx):
        heading = f"# `{ctx.command_path}`" if ctx.parent else "# The `hybrid` command"
        assert heading in page, f"{ctx.command_path} is missing from {docs.CLI_PAGE}"
        for p in cmd.get_params(ctx):
            if isinstance(p, click.Option) and "--help" not in p.opts:
                assert f"| `{p.opts[0]}" in page, f"{ctx.command_path} {p.opts[0]} is missing from {docs.CLI_PAGE}"
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, click.Context(sub, info_name=name, parent=ctx))

    walk(cli, click.Context(cli, info_name="hybrid"))
    assert "| `--text-field TEXT` | `text` |" in page
    assert "| `--out PATH` | **required** |" in page


def test_check_mode_names_each_stale_page_and_the_command_then_writing_them_makes_them_current(tmp_path, capsys,
                                                                                              monkeypatch):
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    for rel in docs.render():
        assert f"{rel} differs from what `{docs.COMMAND}` writes; run it" in err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0
    (tmp_path / docs.CLI_PAGE).write_text("edited by hand\n")
    assert docs.stale() == [docs.CLI_PAGE]
